"""From buffer groups to micro-batches, and from a model to per-token logprobs.

A sample is prompt + completion; the hidden state at position `len(prompt) − 1 + t` of its
sequence predicts completion token t, so logprobs come out aligned with the engine's behaviour
logprobs ([N, T], T = longest completion of the micro-batch). Micro-batches are padded (one
right-padded row per sample) or packed (samples back to back, `max_tokens_per_micro_batch`):
the same [N, T] tensors either way, so the loss cannot tell them apart.
Samples whose reward status is not `scored` stay in the batch with mask 0 (they carry no
advantage) and are counted by the caller; padding rows that even out the ranks are all-mask-0.
In an episode the environment's tokens (a sample's `loss_mask` 0) are in the sequence, as
context, with mask 0: no loss, entropy or importance weight ever counts them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from asyncrl.proto import Group, RewardStatus
from asyncrl.trainer.advantages import AdvantageKind, group_advantages, overlong_penalty, zero_spread
from asyncrl.trainer.logprobs import model_logprobs


@dataclass
class Row:
    prompt_tokens: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    advantage: float
    valid: bool  # reward scored: counts in the loss
    loss_mask: np.ndarray | None = None  # 1 per token the policy sampled (episodes); None: all


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
    # Filled in numpy: a torch element write costs ~5 µs, twice per sample and twice per step.
    rewards = np.full((len(groups), n_max), np.nan, dtype=np.float64)
    valid = np.zeros((len(groups), n_max), dtype=bool)
    for gi, g in enumerate(groups):
        s = g.samples  # column-wise: sample i is entry i of each column
        for i, (reward, status, length) in enumerate(zip(s.reward, s.reward_status, s.lengths)):
            if s.episode and s.episode[i] not in (None, i):
                continue  # a later piece of an episode: the episode counts once (its first piece)
            if status is RewardStatus.scored:
                r = float(reward)
                if shaping is not None and shaping.max_len is not None:
                    r += float(
                        overlong_penalty(
                            torch.tensor([length]), shaping.max_len, shaping.cache_len, shaping.factor
                        )[0]
                    )
                rewards[gi, i], valid[gi, i] = r, True
    return torch.from_numpy(rewards), torch.from_numpy(valid)


def zero_spread_groups(groups: list[Group], shaping: Shaping | None = None) -> list[bool]:
    """Groups without a learning signal (all valid rewards equal, or fewer than two)."""
    if not groups:
        return []
    rewards, valid = rewards_matrix(groups, shaping)
    return zero_spread(rewards, valid).tolist()


def build_rows(groups: list[Group], kind: AdvantageKind, shaping: Shaping | None = None) -> GroupBatch:
    """Advantages per group, then one Row per sample (in group order)."""
    rewards, valid = rewards_matrix(groups, shaping)
    adv = group_advantages(rewards, kind, valid).tolist()  # read per sample below: lists, not tensors
    out = GroupBatch(rows=[], rewards=rewards[valid].tolist())
    valid = valid.tolist()
    for gi, g in enumerate(groups):
        s, start, p = g.samples, 0, 0  # sample i's tokens: the next lengths[i] of each token column
        masks = s.loss_mask if len(s.loss_mask) else None
        for i, (length, status, truncated) in enumerate(zip(s.lengths, s.reward_status, s.truncated)):
            first = (
                s.episode[i] if s.episode and s.episode[i] is not None else i
            )  # pieces share their episode's advantage
            ok, end = valid[gi][first], start + length
            prompt = g.prompt_tokens
            if s.prompt_lengths and s.prompt_lengths[i]:
                prompt, p = s.prompt_ids[p : p + s.prompt_lengths[i]], p + s.prompt_lengths[i]
            if not ok:
                out.masked[status.value if status else "unscored"] += 1
            out.rows.append(
                Row(
                    prompt,
                    s.completion_ids[start:end],
                    s.behavior_logprobs[start:end],
                    float(adv[gi][first]) if ok else 0.0,
                    ok,
                    masks[start:end] if masks is not None else None,
                )
            )
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
    """The tensors of one micro-batch: N samples laid out in R rows of L positions, padded
    (R = N, right padding, `attention_mask`) or packed (R = 1, the samples back to back with
    `position_ids` restarting at 0 at each, no padding at all). The per-token tensors are
    [N, T], T = the longest completion; `token_index` says which of the R·L positions' hidden
    state predicts completion token t, `present` which (sample, t) exist."""

    input_ids: torch.Tensor  # [R, L] long
    attention_mask: torch.Tensor | None  # [R, L] long (padded layout) or None (packed)
    position_ids: torch.Tensor | None  # [R, L] long (packed layout) or None (padded: 0..L-1)
    token_index: torch.Tensor  # [N, T] long: flat position (row · L + column) predicting token t
    present: torch.Tensor  # [N, T] bool: completion token t exists
    targets: torch.Tensor  # [N, T] long
    mask: torch.Tensor  # [N, T] float: 1 where the token counts in the loss
    behavior_logprobs: torch.Tensor  # [N, T] float
    advantages: torch.Tensor  # [N, T] float
    real_rows: int  # samples (not rank padding)

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def to(self, device: torch.device) -> Batch:
        return Batch(
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        )


class _Tokens:
    """[N, T] per-token arrays of a micro-batch, filled in numpy for all its samples at once (a
    handful of torch ops per row cost ~30 µs each; numpy slices per row ~5 µs a sample) and made
    tensors once."""

    def __init__(self, n: int, t_max: int):
        self.token_index = np.zeros((n, t_max), dtype=np.int64)
        self.present = np.zeros((n, t_max), dtype=bool)
        self.targets = np.zeros((n, t_max), dtype=np.int64)
        self.mask = np.zeros((n, t_max), dtype=np.float32)
        self.behavior = np.zeros((n, t_max), dtype=np.float32)
        self.adv = np.zeros((n, t_max), dtype=np.float32)

    def fill(
        self, index: list[int], rows: list[Row], first: list[int], rest: list[int] | None = None
    ) -> None:
        """Sample index[k] is rows[k]: its completion token 0 is predicted by flat position
        first[k], token t > 0 by first[k] + t, or by rest[k] + t − 1 when given (a shared-prompt
        row, where a completion's own tokens start elsewhere)."""
        if not rows:
            return
        lengths = np.fromiter((len(r.completion_ids) for r in rows), dtype=np.int64, count=len(rows))
        total = int(lengths.sum())
        if not total:
            return
        sample = np.repeat(np.asarray(index, dtype=np.int64), lengths)
        t = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = np.repeat(np.asarray(first, dtype=np.int64), lengths) + t
        if rest is not None:
            position = np.where(
                t == 0, position, np.repeat(np.asarray(rest, dtype=np.int64), lengths) + t - 1
            )
        valid = np.fromiter((r.valid for r in rows), dtype=bool, count=len(rows))
        self.token_index[sample, t] = position
        self.present[sample, t] = True
        self.targets[sample, t] = np.concatenate([r.completion_ids for r in rows])
        self.behavior[sample, t] = np.concatenate([r.behavior_logprobs for r in rows])
        if all(r.loss_mask is None for r in rows):
            self.mask[sample, t] = np.repeat(valid.astype(np.float32), lengths)
        else:
            self.mask[sample, t] = np.concatenate(
                [
                    (np.ones(n, np.float32) if r.loss_mask is None else np.asarray(r.loss_mask, np.float32))
                    * r.valid
                    for r, n in zip(rows, lengths.tolist())
                ]
            )
        advantages = np.fromiter(
            (r.advantage if r.valid else 0.0 for r in rows), dtype=np.float32, count=len(rows)
        )
        self.adv[sample, t] = np.repeat(advantages, lengths)

    def batch(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None,
        position_ids: np.ndarray | None,
        real_rows: int,
    ) -> Batch:
        def t(a):
            return None if a is None else torch.from_numpy(a)

        return Batch(
            t(input_ids),
            t(attention_mask),
            t(position_ids),
            t(self.token_index),
            t(self.present),
            t(self.targets),
            t(self.mask),
            t(self.behavior),
            t(self.adv),
            real_rows,
        )


def _sequence(row: Row) -> np.ndarray:
    return np.concatenate([row.prompt_tokens, row.completion_ids]).astype(np.int64)


def collate(rows: list[Row | None], pad_id: int) -> Batch:
    """Padded layout: one right-padded row per sample; a rank's filler row (None) is one
    attended padding token with no completion."""
    n = len(rows)
    lengths = [(len(r.prompt_tokens), len(r.completion_ids)) if r is not None else (1, 0) for r in rows]
    seq_len = max(p + c for p, c in lengths)
    tokens = _Tokens(n, max(1, max(c for _, c in lengths)))
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    attention = np.zeros((n, seq_len), dtype=np.int64)
    real = [
        (i, row, i * seq_len + p - 1) for i, (row, (p, _)) in enumerate(zip(rows, lengths)) if row is not None
    ]
    for i, (row, (p, c)) in enumerate(zip(rows, lengths)):
        attention[i, : p + c] = 1
        if row is not None:
            input_ids[i, : p + c] = _sequence(row)
    tokens.fill([i for i, _, _ in real], [row for _, row, _ in real], [first for _, _, first in real])
    return tokens.batch(input_ids, attention, None, len(real))


def collate_packed(rows: list[Row | None], pad_id: int) -> Batch:
    """Packed layout: the samples back to back in one row, position ids restarting at 0 at
    each (the model's attention then never crosses samples: tests/unit/trainer/test_logprobs.py).
    Filler rows (None) are left out; a bin of fillers only is one padding token."""
    real = [r for r in rows if r is not None]
    if not real:
        return _Tokens(1, 1).batch(
            np.full((1, 1), pad_id, dtype=np.int64), None, np.zeros((1, 1), dtype=np.int64), 0
        )
    tokens = _Tokens(len(real), max(1, max(len(r.completion_ids) for r in real)))
    seqs, positions, firsts, offset = [], [], [], 0
    for row in real:
        seq = _sequence(row)
        seqs.append(seq)
        positions.append(np.arange(len(seq)))
        firsts.append(offset + len(row.prompt_tokens) - 1)
        offset += len(seq)
    tokens.fill(list(range(len(real))), real, firsts)
    return tokens.batch(np.concatenate(seqs)[None], None, np.concatenate(positions)[None], len(real))


MAX_SHARED_ROW_TOKENS = 4096  # a shared-prompt row's dense [L, L] mask stays ≤ 16 MB


def _trees(rows: list[Row]) -> list[list[tuple[int, Row]]]:
    """(index, row) grouped by identical prompt tokens, in first-seen order."""
    trees: dict[bytes, list[tuple[int, Row]]] = {}
    for i, row in enumerate(rows):
        trees.setdefault(np.ascontiguousarray(row.prompt_tokens, dtype=np.int64).tobytes(), []).append(
            (i, row)
        )
    return list(trees.values())


def _tree_length(tree: list[tuple[int, Row]]) -> int:
    """The prompt once, then each completion without its last token (it predicts nothing)."""
    return len(tree[0][1].prompt_tokens) + sum(max(len(r.completion_ids) - 1, 0) for _, r in tree)


def collate_shared(rows: list[Row | None], pad_id: int) -> Batch:
    """Shared-prompt layout: the samples of a micro-batch that have the same prompt (a group's)
    become one row, the prompt once and then each completion minus its last token, with a
    tree-shaped attention mask ([R, 1, L, L], True = attends): the prompt causal on itself, each
    completion on the whole prompt and causally on itself, never on another completion. Position
    ids continue from the prompt in every completion. Completion token 0 of every sample is
    predicted by the prompt's last position, token t > 0 by its own token t − 1: the logprobs,
    entropies and gradients of the padded layout, with the prompt's forward and backward done
    once per group instead of once per sample (and no position that predicts nothing). The
    samples keep their order in `rows` ([N, T] tensors); filler rows (None) are left out and
    each is a row of one padding token, as in `collate`. Falls back to
    `collate` when a row would exceed MAX_SHARED_ROW_TOKENS."""
    real = [r for r in rows if r is not None]
    trees = _trees(real)
    lengths = [_tree_length(t) for t in trees] + [1] * (len(rows) - len(real))
    seq_len = max(lengths, default=1)
    if seq_len > MAX_SHARED_ROW_TOKENS:
        return collate(rows, pad_id)
    n_rows = len(lengths)
    tokens = _Tokens(max(len(real), 1), max(1, max((len(r.completion_ids) for r in real), default=1)))
    input_ids = np.full((n_rows, seq_len), pad_id, dtype=np.int64)
    positions = np.zeros((n_rows, seq_len), dtype=np.int64)
    segment = np.full((n_rows, seq_len), -1, dtype=np.int64)  # 0: the prompt, k: completion k, -1: padding
    index, members, firsts, rests = [], [], [], []
    for r, tree in enumerate(trees):
        prompt = tree[0][1].prompt_tokens
        p = len(prompt)
        spans = np.array([max(len(row.completion_ids) - 1, 0) for _, row in tree], dtype=np.int64)
        starts = np.cumsum(spans) - spans  # of each completion, after the prompt
        end = p + int(spans.sum())
        input_ids[r, :end] = np.concatenate(
            [prompt, *(row.completion_ids[: max(len(row.completion_ids) - 1, 0)] for _, row in tree)]
        )
        segment[r, :p] = 0
        segment[r, p:end] = np.repeat(np.arange(1, len(tree) + 1), spans)
        positions[r, :p] = np.arange(p)
        positions[r, p:end] = p + np.arange(end - p) - np.repeat(starts, spans)  # continuing from the prompt
        index += [i for i, _ in tree]  # sample i keeps its place in `rows`
        members += [row for _, row in tree]
        firsts += [r * seq_len + p - 1] * len(tree)
        rests += (r * seq_len + p + starts).tolist()
    # Position i attends to j ≤ i of the prompt or of its own completion; padding to itself only.
    at = np.arange(seq_len)
    own, other = segment[:, :, None], segment[:, None, :]
    mask = (at[None, :] <= at[:, None])[None] & (own >= 0) & ((other == 0) | (other == own))
    mask[:, at, at] = True  # padding attends to itself: no empty softmax row
    tokens.fill(index, members, firsts, rests)
    return tokens.batch(input_ids, mask[:, None], positions, len(real))


def pack(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """First-fit decreasing into bins of at most `max_tokens` prompt + completion tokens; a
    sample longer than the budget gets a bin of its own (a sample is never split)."""
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in sorted(rows, key=_row_length, reverse=True):
        n = _row_length(row)
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(max_tokens - n)
    return bins


def micro_batches(
    rows: list[Row],
    rank: int,
    world: int,
    minibatches: int,
    micro_batch_size: int,
    pad_id: int,
    device: torch.device,
    max_tokens: int = 0,
    share_prompts: bool = False,
) -> list[Batch]:
    """This rank's share of the rows as micro-batches on `device`, minibatch by minibatch: every
    minibatch has the same number of micro-batches on every rank (FSDP needs every rank to run
    the same number of forwards).

    `max_tokens` = 0: padded micro-batches of `micro_batch_size` rows, longest first, so each
    pads to rows of similar length. `max_tokens` > 0: packed micro-batches of at most that many
    tokens (`pack`), no padding; every minibatch gets as many bins as the fullest one on any rank
    (the others run empty ones). `share_prompts` (with `max_tokens` = 0): micro-batches of
    `micro_batch_size` rows in the shared-prompt layout (`collate_shared`), a prompt's samples
    kept next to each other. The loss is the same either way: its denominators are the whole
    minibatch's."""
    mine = shard_rows(rows, rank, world, multiple=minibatches)
    per_mb = len(mine) // minibatches
    chunks = [
        sorted(mine[m * per_mb : (m + 1) * per_mb], key=_row_length, reverse=True) for m in range(minibatches)
    ]
    if share_prompts:  # a prompt's samples next to each other, fillers last
        chunks = [
            [row for tree in _trees([r for r in c if r is not None]) for _, row in tree]
            + [r for r in c if r is None]
            for c in chunks
        ]
        return [
            collate_shared(c[i : i + micro_batch_size], pad_id).to(device)
            for c in chunks
            for i in range(0, len(c), micro_batch_size)
        ]
    if max_tokens <= 0:
        return [
            collate(c[i : i + micro_batch_size], pad_id).to(device)
            for c in chunks
            for i in range(0, len(c), micro_batch_size)
        ]
    bins = [pack([r for r in c if r is not None], max_tokens) for c in chunks]
    most = torch.tensor([max(len(b) for b in bins)], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size() > 1:
        most = most.to(device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    n = max(int(most), 1)  # every minibatch on every rank: n bins (policy_step splits micro evenly)
    return [collate_packed(rows_, pad_id).to(device) for b in bins for rows_ in b + [[None]] * (n - len(b))]


def _row_length(row: Row | None) -> int:
    """Prompt + completion tokens; a rank's filler row (None) sorts last."""
    return -1 if row is None else len(row.prompt_tokens) + len(row.completion_ids)


def token_logprobs(
    model: nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target_t) [N, T] at the sampling temperature (fp32, 0 where no token), and the
    entropy [N, T] if asked. Only the hidden states that predict a completion token go through
    the LM head, `chunk_tokens` of them at a time when > 0 (trainer/logprobs.py)."""
    lp, ent = model_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.token_index[batch.present],
        batch.targets[batch.present],
        temperature,
        chunk_tokens,
        with_entropy,
    )
    zeros = torch.zeros(batch.targets.shape, dtype=lp.dtype, device=lp.device)
    return zeros.masked_scatter(batch.present, lp), (
        zeros.masked_scatter(batch.present, ent) if with_entropy else None
    )
