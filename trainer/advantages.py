"""Group-relative advantages (docs/architecture.md §6) and DAPO reward shaping: pure tensor functions.

`rewards` is [G, n]: G groups of n samples of the same prompt. A sample whose reward is
missing (its verifier timed out or failed) is passed as NaN together with `valid`=False; it
gets advantage 0 and does not enter its group's statistics. A group with fewer than two valid
samples has no baseline and gets advantage 0 everywhere.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]

STD_EPS = 1e-6  # keeps a zero-spread group's advantage at 0 instead of 0/0


def group_advantages(rewards: Tensor, kind: AdvantageKind, valid: Tensor | None = None) -> Tensor:
    """Advantages [G, n] from rewards [G, n].

    grpo: (r − mean) / (std + 1e-6), std unbiased · dr_grpo: r − mean ·
    rloo: r_i − mean_{j≠i} r_j · reinforce_pp: r − group mean, then normalised by the mean and
    (unbiased) std over every valid sample of the batch.
    Statistics use only `valid` samples (default: all finite rewards).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)
    if valid is None:
        valid = torch.isfinite(rewards)
    valid = valid.bool() & torch.isfinite(rewards)
    v = valid.to(rewards.dtype)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = v.sum(dim=1, keepdim=True)
    usable = (count >= 2).to(rewards.dtype)  # groups with a baseline
    mean = r.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (r - mean) * v * usable

    if kind == "grpo":
        var = (centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        adv = centred / (var.sqrt() + STD_EPS)
    elif kind == "dr_grpo":
        adv = centred
    elif kind == "rloo":
        # r_i − (Σ r − r_i)/(k − 1) = k/(k − 1) · (r_i − mean)
        adv = centred * count / (count - 1).clamp(min=1)
    elif kind == "reinforce_pp":
        sel = (v * usable).bool()
        if int(sel.sum()) >= 2:
            batch_mean = centred[sel].mean()
            batch_std = centred[sel].std(unbiased=True)
            adv = (centred - batch_mean) / (batch_std + STD_EPS) * v * usable
        else:
            adv = centred
    else:
        raise ValueError(f"unknown advantage kind {kind!r}")
    return adv.to(torch.float32)


def zero_spread(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """[G] bool: groups whose valid rewards are all equal (no learning signal; DAPO skips them)."""
    if valid is None:
        valid = torch.isfinite(rewards)
    big = torch.finfo(rewards.dtype).max
    hi = torch.where(valid, rewards, torch.full_like(rewards, -big)).max(dim=1).values
    lo = torch.where(valid, rewards, torch.full_like(rewards, big)).min(dim=1).values
    return (hi <= lo) | (valid.sum(dim=1) < 2)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment added to the reward, per sample [N] from lengths [N].

    0 while length ≤ max_len − cache_len; then falls linearly to −factor at length = max_len;
    −factor beyond.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"cache_len must be in (0, max_len], got {cache_len} for max_len {max_len}")
    start = max_len - cache_len
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -factor * (over / cache_len).clamp(max=1.0)
