"""Off-policy policy-gradient losses (docs/architecture.md §6): pure functions of tensors.

Shapes: B rows (one per sample), T completion positions (right-padded). `mask` is 1 where a
token counts. Padded positions may hold any finite or non-finite value: they are replaced
before any arithmetic, so they never leak NaN into the loss or its gradient.

Two probability ratios appear:
* `r = π_θ / π_old` (trainer vs its own proximal policy) is what PPO/GSPO clip;
* `ρ = π_old / μ` (trainer's proximal policy vs the engine that sampled) is the behaviour
  correction, always detached: it fixes staleness and the training/inference mismatch.
In bypass mode the caller passes `behavior_logprobs` as `old_logprobs`, so ρ ≡ 1.

Distributed use: a rank sees only part of the batch, so the aggregation denominator of the
whole batch can be passed in (`denominator=`) and the rank's loss is its share of the global
mean. Not provided here: value functions, dual-clip, per-token advantages beyond broadcast.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from asyncrl.trainer.loss_config import Aggregation, ISCorrection, LossConfig, LossKind

__all__ = [
    "MAX_LOG_RATIO",
    "Aggregation",
    "ISCorrection",
    "LossConfig",
    "LossKind",
    "aggregate",
    "entropy_bonus",
    "entropy_from_logits",
    "is_weights",
    "kl_penalty",
    "policy_loss",
]

MAX_LOG_RATIO = 20.0  # keeps exp() finite when trainer and engine disagree wildly (e^20 ≈ 4.9e8)

KLKind = Literal["k1", "k2", "k3"]


def _clamped_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """a − b clamped to ±MAX_LOG_RATIO, 0 where the mask is off (padding never makes NaN)."""
    diff = torch.where(mask > 0, a - b, torch.zeros_like(a))
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _row_sum(x: Tensor, mask: Tensor) -> Tensor:
    """[B, T] → [B]: masked sum of each row."""
    return (x * mask).sum(dim=-1)


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, T] → [B]: masked mean of each row (0 for a row with no tokens)."""
    return _row_sum(x, mask) / mask.sum(dim=-1).clamp(min=1.0)


def is_weights(
    log_rho: Tensor, mask: Tensor, correction: ISCorrection, is_low: float, is_high: float
) -> Tensor:
    """Behaviour-correction weight w [B, T] from log ρ = log π_old − log μ [B, T] (no grad)."""
    log_rho = log_rho.detach()
    ones = torch.ones_like(log_rho)
    if correction == "none":
        w = ones
    elif correction in ("tis", "icepop", "token_mask"):
        rho = log_rho.exp()
        inside = ((rho >= is_low) & (rho <= is_high)).to(rho.dtype)
        w = {"tis": rho.clamp(max=is_high), "icepop": rho * inside, "token_mask": inside}[correction]
    elif correction in ("seq_tis", "seq_mask", "geo_mask"):
        if correction == "geo_mask":
            seq_log_rho = _row_mean(log_rho, mask)
        else:
            seq_log_rho = _row_sum(log_rho, mask)
        seq_rho = seq_log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        if correction == "seq_tis":
            seq_w = seq_rho.clamp(max=is_high)
        else:
            seq_w = ((seq_rho >= is_low) & (seq_rho <= is_high)).to(seq_rho.dtype)
        w = seq_w[:, None].expand_as(log_rho)
    else:
        raise ValueError(f"unknown is_correction {correction!r}")
    return w * mask


def aggregate(
    values: Tensor,
    mask: Tensor,
    agg: Aggregation,
    max_tokens: int | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar.

    `token_mean`: Σ v·m / Σ m. `seq_mean_token_mean`: mean over rows with tokens of each row's
    token mean. `seq_mean_token_sum_norm`: Σ v·m / (B · max_tokens) (Dr. GRPO). `denominator`
    replaces the local one (Σ m, the number of rows with tokens, or B · max_tokens) when the
    batch is split across ranks or micro-batches.
    """
    mask = mask.to(values.dtype)
    values = torch.where(mask > 0, values, torch.zeros_like(values))
    if agg == "token_mean":
        numerator, local = (values * mask).sum(), mask.sum()
    elif agg == "seq_mean_token_mean":
        numerator, local = _row_mean(values, mask).sum(), (mask.sum(dim=-1) > 0).sum()
    elif agg == "seq_mean_token_sum_norm":
        if max_tokens is None:
            raise ValueError("seq_mean_token_sum_norm needs max_tokens")
        numerator, local = (values * mask).sum(), torch.tensor(values.shape[0] * max_tokens)
    else:
        raise ValueError(f"unknown aggregation {agg!r}")
    denom = float(local) if denominator is None else float(denominator)
    return numerator / max(denom, 1.0)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy-gradient loss of one (micro-)batch and its metrics.

    logprobs [B, T]: log π_θ of the sampled tokens (requires grad).
    old_logprobs [B, T]: log π_old, the trainer's recompute at the start of the step
        (decoupled mode); in bypass mode pass behavior_logprobs.
    behavior_logprobs [B, T]: log μ from the engine.
    advantages [B, T]; mask [B, T] (1 = token counts).
    Returns (scalar loss, metrics). Metrics are means over masked tokens of this call:
    clip_frac, is_weight_mean, is_weight_max, is_masked_frac (tokens the correction zeroed),
    mismatch_kl (k3 of μ against π_old), approx_kl (k3 of π_old against π_θ).
    """
    mask = mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    behavior_logprobs = behavior_logprobs.detach()
    advantages = torch.where(mask > 0, advantages.detach(), torch.zeros_like(advantages))
    log_r = _clamped_log_ratio(logprobs, old_logprobs, mask)
    log_rho = _clamped_log_ratio(old_logprobs, behavior_logprobs, mask)
    w = is_weights(log_rho, mask, cfg.is_correction, cfg.is_low, cfg.is_high)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high

    if cfg.kind == "ppo":
        r = log_r.exp()
        unclipped, clipped = r * advantages, r.clamp(lo, hi) * advantages
        token_loss = -w * torch.min(unclipped, clipped)
        clip_active = (clipped < unclipped).to(mask.dtype)  # the clipped branch (no gradient) was taken
    elif cfg.kind == "gspo":
        seq_log_s = _row_mean(log_r, mask)  # [B]: log of the length-normalised sequence ratio
        s = seq_log_s.exp()
        seq_adv = _row_mean(advantages, mask)
        unclipped, clipped = s * seq_adv, s.clamp(lo, hi) * seq_adv
        seq_w = _row_mean(w, mask)  # sequence corrections are constant per row; token ones are averaged
        seq_loss = -seq_w * torch.min(unclipped, clipped)
        token_loss = seq_loss[:, None].expand_as(logprobs)
        clip_active = (clipped < unclipped).to(mask.dtype)[:, None].expand_as(logprobs)
    elif cfg.kind == "cispo":
        r = log_r.exp()
        weight = r.clamp(max=hi).detach()  # CISPO: the clipped ratio is a stop-gradient weight
        safe_logprobs = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))
        token_loss = -w * weight * advantages * safe_logprobs
        clip_active = (r > hi).to(mask.dtype)
    else:
        raise ValueError(f"unknown loss kind {cfg.kind!r}")

    loss = aggregate(token_loss, mask, cfg.agg, cfg.max_tokens, denominator)

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        rho = log_rho.exp()
        r_detached = log_r.detach().exp()
        metrics = {
            "clip_frac": float((clip_active * mask).sum() / n),
            "is_weight_mean": float((w * mask).sum() / n),
            "is_weight_max": float((w * mask).max()) if mask.any() else 0.0,
            "is_masked_frac": float((((w == 0) & (mask > 0)).to(mask.dtype)).sum() / n),
            "mismatch_kl": float(((rho - 1.0 - log_rho) * mask).sum() / n),
            "approx_kl": float(((r_detached - 1.0 - log_r.detach()) * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate [B, T] of KL(π_θ ‖ π_ref) on tokens sampled from π_θ (0 off the mask).

    With log ratio x = log π_θ − log π_ref: k1 = x; k2 = x²/2; k3 = e^{−x} − 1 + x (unbiased,
    non-negative; Schulman's estimators). Gradients flow through `logprobs` only.
    """
    x = _clamped_log_ratio(logprobs, ref_logprobs.detach(), mask.to(logprobs.dtype))
    if kind == "k1":
        kl = x
    elif kind == "k2":
        kl = 0.5 * x * x
    elif kind == "k3":
        kl = torch.exp(-x) - 1.0 + x
    else:
        raise ValueError(f"unknown KL estimator {kind!r}")
    return kl * mask


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy [B, T] of the next-token distribution from logits [B, T, V] (computed in fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    agg: Aggregation = "token_mean",
    max_tokens: int | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Loss term −coef · agg(entropy): subtracting it rewards a spread-out policy."""
    return -coef * aggregate(entropy, mask, agg, max_tokens, denominator)
