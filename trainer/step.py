"""One policy update over this rank's share of a batch: minibatches of micro-batches.

Every loss term is normalised by the *global* denominator of its minibatch (all ranks, all
micro-batches; see `losses.aggregate`), and multiplied by the world size because FSDP
averages gradients over ranks, so the update equals one big-batch step on a single process
(what tests/integration/trainer/test_parity.py checks). Each minibatch is one optimizer step with gradient
clipping; PPO's `r = π_θ/π_old` departs from 1 from the second minibatch on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.trainer.batch import Batch, token_logprobs
from asyncrl.trainer.lora import adapters_off
from asyncrl.trainer.losses import LossConfig, aggregate, entropy_bonus, kl_penalty, policy_loss

SUM_METRICS = ("clip_frac", "is_weight_mean", "is_masked_frac", "mismatch_kl", "approx_kl")


@dataclass
class StepConfig:
    loss: LossConfig
    temperature: float = 1.0
    grad_clip: float = 1.0
    minibatches: int = 1
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    chunk_tokens: int = (
        0  # LM-head tokens per chunk in log-prob/entropy (trainer/logprobs.py); 0: all at once
    )


@torch.no_grad()
def recompute_logprobs(
    model: nn.Module, micro: list[Batch], temperature: float, chunk_tokens: int = 0
) -> list[torch.Tensor]:
    """log π_old (or the reference model's log π_ref) for every micro-batch, with the weights as
    they are before the update."""
    return [token_logprobs(model, mb, temperature, chunk_tokens=chunk_tokens)[0] for mb in micro]


def reference_logprobs(
    model: nn.Module,
    ref_model: nn.Module | None,
    micro: list[Batch],
    temperature: float,
    chunk_tokens: int = 0,
) -> list[torch.Tensor]:
    """log π_ref for every micro-batch, for the KL penalty: the frozen initial model's
    (`ref_model`), or without one, the LoRA policy's own with its adapters switched off: its base,
    which is the initial policy since the adapters start at B = 0 (trainer/lora.py)."""
    if ref_model is not None:
        return recompute_logprobs(ref_model, micro, temperature, chunk_tokens)
    with adapters_off(model):
        return recompute_logprobs(model, micro, temperature, chunk_tokens)


def _local_denominator(mb: Batch, cfg: LossConfig) -> float:
    if cfg.agg == "token_mean":
        return float(mb.mask.sum())
    if cfg.agg == "seq_mean_token_mean":
        return float((mb.mask.sum(-1) > 0).sum())
    return float(mb.real_rows * cfg.max_tokens)


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def policy_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro: list[Batch],
    old_logprobs: list[torch.Tensor | None],
    ref_logprobs: list[torch.Tensor | None],
    cfg: StepConfig,
    device: torch.device,
) -> dict[str, float]:
    """Run `cfg.minibatches` optimizer steps over this rank's micro-batches; return the step's
    metrics averaged over all ranks' tokens (max for is_weight_max). An `old_logprobs` entry of
    None means log π_old is this forward's own, detached: exact for the first minibatch only."""
    if cfg.minibatches > 1 and any(o is None for o in old_logprobs):
        raise ValueError("old_logprobs may be None only with one minibatch (π_θ moves after the first)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(micro) % cfg.minibatches:
        raise ValueError(f"{len(micro)} micro-batches do not split into {cfg.minibatches} equal minibatches")
    per_mb = len(micro) // cfg.minibatches  # micro_batches() makes equal minibatches
    sums = dict.fromkeys((*SUM_METRICS, "entropy", "ref_kl", "tokens", "loss", "grad_norm"), 0.0)
    w_max, t_fb, t_opt = 0.0, 0.0, 0.0
    for m in range(cfg.minibatches):
        idx = range(m * per_mb, min((m + 1) * per_mb, len(micro)))
        denom = _all_reduce(
            [
                sum(_local_denominator(micro[i], cfg.loss) for i in idx),
                sum(float(micro[i].mask.sum()) for i in idx),
            ],
            device,
        )
        loss_den, tok_den = denom[0] / world, denom[1] / world  # FSDP averages grads over ranks
        t0 = time.perf_counter()
        mb_loss = 0.0
        for i in idx:
            mb = micro[i]
            logprobs, entropy = token_logprobs(
                model, mb, cfg.temperature, with_entropy=True, chunk_tokens=cfg.chunk_tokens
            )
            old = logprobs.detach() if old_logprobs[i] is None else old_logprobs[i]  # None: π_old = π_θ now
            loss, stats = policy_loss(
                logprobs, old, mb.behavior_logprobs, mb.advantages, mb.mask, cfg.loss, denominator=loss_den
            )
            if cfg.entropy_coef > 0:
                loss = loss + entropy_bonus(entropy, mb.mask, cfg.entropy_coef, denominator=tok_den)
            if ref_logprobs[i] is not None:
                kl = kl_penalty(logprobs, ref_logprobs[i], mb.mask, cfg.kl_kind)
                if cfg.kl_coef > 0:
                    loss = loss + cfg.kl_coef * aggregate(kl, mb.mask, "token_mean", denominator=tok_den)
                sums["ref_kl"] += float(kl.detach().sum())
            loss.backward()
            mb_loss += float(loss.detach())
            n = stats["tokens"]
            for k in SUM_METRICS:
                sums[k] += stats[k] * n
            sums["entropy"] += float((entropy.detach() * mb.mask).sum())
            sums["tokens"] += n
            w_max = max(w_max, stats["is_weight_max"])
        t1 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        sums["loss"] += mb_loss / world  # ranks' shares add up to the minibatch loss
        sums["grad_norm"] += float(grad_norm) / world  # identical on every rank
        t_fb, t_opt = t_fb + (t1 - t0), t_opt + (t2 - t1)
    keys = list(sums)
    totals = dict(zip(keys, _all_reduce([sums[k] for k in keys], device)))
    tokens = max(totals["tokens"], 1.0)
    out = {k: totals[k] / tokens for k in (*SUM_METRICS, "entropy", "ref_kl")}
    out["is_weight_max"] = _all_reduce([w_max], device, dist.ReduceOp.MAX)[0]
    out["loss"] = totals["loss"] / cfg.minibatches
    out["grad_norm"] = totals["grad_norm"] / cfg.minibatches
    out["tokens"] = totals["tokens"]
    out["forward_backward_s"], out["optimizer_s"] = t_fb, t_opt
    return out
