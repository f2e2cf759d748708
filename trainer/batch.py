"""From buffer groups to padded tensors, and from a model to per-token logprobs.

A row is one sample: prompt + completion laid out left-aligned and right-padded. Logits at
position `len(prompt) − 1 + t` predict completion token t, so logprobs come out aligned with
the engine's behaviour logprobs ([N, T], T = longest completion of the micro-batch).
Samples whose reward status is not `scored` stay in the batch with mask 0 (they carry no
advantage) and are counted by the caller; padding rows that even out the ranks are all-mask-0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from proto import Group, RewardStatus
from trainer.advantages import AdvantageKind, group_advantages, overlong_penalty, zero_spread


@dataclass
class Row:
    prompt_tokens: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    advantage: float
    valid: bool  # reward scored: counts in the loss


@dataclass
class Shaping:
    """DAPO soft overlong punishment (off when max_len is None)."""

    max_len: int | None = None
    cache_len: int = 0
    factor: float = 1.0


@dataclass
class GroupBatch:
    """The rows of a step plus what the metrics need about them."""

    rows: list[Row]
    rewards: list[float]  # scored rewards after shaping
    masked: Counter = field(default_factory=Counter)  # reward status → samples masked out
    lengths: list[int] = field(default_factory=list)
    truncated: int = 0


def rewards_matrix(groups: list[Group], shaping: Shaping | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, n_max] rewards (NaN where missing) and the `valid` mask, with overlong shaping applied."""
    n_max = max(len(g.samples) for g in groups)
    rewards = torch.full((len(groups), n_max), float("nan"), dtype=torch.float64)
    valid = torch.zeros((len(groups), n_max), dtype=torch.bool)
    for gi, g in enumerate(groups):
        s = g.samples  # column-wise: sample i is entry i of each column
        for i, (reward, status, length) in enumerate(zip(s.reward, s.reward_status, s.lengths)):
            if status is RewardStatus.scored:
                r = float(reward)
                if shaping is not None and shaping.max_len is not None:
                    r += float(overlong_penalty(torch.tensor([length]), shaping.max_len,
                                                shaping.cache_len, shaping.factor)[0])  # fmt: skip
                rewards[gi, i], valid[gi, i] = r, True
    return rewards, valid


def zero_spread_groups(groups: list[Group], shaping: Shaping | None = None) -> list[bool]:
    """Groups without a learning signal (all valid rewards equal, or fewer than two)."""
    if not groups:
        return []
    rewards, valid = rewards_matrix(groups, shaping)
    return zero_spread(rewards, valid).tolist()


def build_rows(groups: list[Group], kind: AdvantageKind, shaping: Shaping | None = None) -> GroupBatch:
    """Advantages per group, then one Row per sample (in group order)."""
    rewards, valid = rewards_matrix(groups, shaping)
    adv = group_advantages(rewards, kind, valid)
    out = GroupBatch(rows=[], rewards=rewards[valid].tolist())
    for gi, g in enumerate(groups):
        s, start = g.samples, 0  # sample i's tokens: the next lengths[i] of each token column
        for i, (length, status, truncated) in enumerate(zip(s.lengths, s.reward_status, s.truncated)):
            ok, end = bool(valid[gi, i]), start + length
            if not ok:
                out.masked[status.value if status else "unscored"] += 1
            out.rows.append(Row(g.prompt_tokens, s.completion_ids[start:end], s.behavior_logprobs[start:end],
                                float(adv[gi, i]) if ok else 0.0, ok))  # fmt: skip
            out.lengths.append(length)
            out.truncated += int(truncated)
            start = end
    return out


def shard_rows(rows: list[Row], rank: int, world: int, multiple: int = 1) -> list[Row | None]:
    """This rank's rows (round robin), padded with None so every rank has the same count, a
    multiple of `multiple` (FSDP needs every rank to run the same number of forwards)."""
    per_rank = -(-len(rows) // world)
    per_rank = -(-per_rank // multiple) * multiple
    mine: list[Row | None] = list(rows[rank::world])
    return mine + [None] * (per_rank - len(mine))


@dataclass
class Batch:
    """Padded tensors of a micro-batch. N rows, L = longest prompt+completion, T = longest completion."""

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    logit_pos: torch.Tensor  # [N, T] long: position whose logits predict completion token t
    targets: torch.Tensor  # [N, T] long
    mask: torch.Tensor  # [N, T] float
    behavior_logprobs: torch.Tensor  # [N, T] float
    advantages: torch.Tensor  # [N, T] float
    real_rows: int  # rows that are samples (not rank padding)
    first_logit: int = 0  # earliest position whose logits any row needs (positions before it are prompt)

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


def collate(rows: list[Row | None], pad_id: int) -> Batch:
    n = len(rows)
    lengths = [(len(r.prompt_tokens), len(r.completion_ids)) if r is not None else (1, 0) for r in rows]
    seq_len = max(p + c for p, c in lengths)
    t_max = max(1, max(c for _, c in lengths))
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((n, seq_len), dtype=torch.long)
    logit_pos = torch.zeros((n, t_max), dtype=torch.long)
    targets = torch.zeros((n, t_max), dtype=torch.long)
    mask = torch.zeros((n, t_max), dtype=torch.float32)
    behavior = torch.zeros((n, t_max), dtype=torch.float32)
    adv = torch.zeros((n, t_max), dtype=torch.float32)
    for i, (row, (p, c)) in enumerate(zip(rows, lengths)):
        attention[i, : p + c] = 1
        if row is None:
            continue
        input_ids[i, :p] = torch.from_numpy(row.prompt_tokens.astype(np.int64))
        input_ids[i, p : p + c] = torch.from_numpy(row.completion_ids.astype(np.int64))
        logit_pos[i, :c] = torch.arange(p - 1, p - 1 + c)
        targets[i, :c] = input_ids[i, p : p + c]
        behavior[i, :c] = torch.tensor(row.behavior_logprobs)  # a copy: record arrays are read-only views
        if row.valid:
            mask[i, :c] = 1.0
            adv[i, :c] = row.advantage
    real = sum(r is not None for r in rows)
    first = min((p - 1 for p, c in lengths if c > 0), default=0)
    return Batch(input_ids, attention, logit_pos, targets, mask, behavior, adv, real, first)


def micro_batches(rows: list[Row], rank: int, world: int, minibatches: int, micro_batch_size: int, pad_id: int,
                  device: torch.device) -> list[Batch]:  # fmt: skip
    """This rank's share of the rows as padded micro-batches on `device`, minibatch by minibatch:
    every minibatch has the same number of rows and of micro-batches, on every rank.

    Within a minibatch the rows go into micro-batches longest first, so each micro-batch pads to
    rows of similar length (answers of 40 and 200 tokens in one batch would otherwise compute a
    long tail of padding). The loss is unchanged: its denominators are the whole minibatch's."""
    mine = shard_rows(rows, rank, world, multiple=minibatches)
    per_mb = len(mine) // minibatches
    out = []
    for m in range(minibatches):
        chunk = sorted(mine[m * per_mb : (m + 1) * per_mb], key=_row_length, reverse=True)
        out += [collate(chunk[i : i + micro_batch_size], pad_id).to(device) for i in range(0, len(chunk), micro_batch_size)]
    return out


def _row_length(row: Row | None) -> int:
    """Prompt + completion tokens; a rank's filler row (None) sorts last."""
    return -1 if row is None else len(row.prompt_tokens) + len(row.completion_ids)


def token_logprobs(
    model: nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target_t) [N, T] at the sampling temperature (fp32), and the entropy [N, T] if asked.

    Only the completion positions' logits are normalised, so memory is N·T·V, not N·L·V."""
    # Only positions from the earliest completion logit on go through the LM head: with a 49k
    # vocabulary the head and its softmax are a large share of the step, and prompts are long.
    keep = batch.input_ids.shape[1] - batch.first_logit
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits
    vocab = logits.shape[-1]
    pos = batch.logit_pos - (batch.input_ids.shape[1] - logits.shape[1])  # a model that ignores it keeps all
    sel = logits.gather(1, pos.clamp(min=0).unsqueeze(-1).expand(-1, -1, vocab)).float() / temperature
    logp = torch.log_softmax(sel, dim=-1)
    lp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, entropy
