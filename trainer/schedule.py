"""Learning-rate schedule: linear warmup, then constant or cosine decay (a torch `LambdaLR`).

The lr of update n (the optimizer step or steps that produce version n, n ≥ 1) is `lr · f(n)`:

    warmup, n ≤ W:         f = n / W                  (update W takes the full lr)
    constant, n > W:       f = 1
    cosine, W < n ≤ D:     f = m + (1 − m) · ½ (1 + cos(π (n − W) / (D − W)))   (update D: f = m)
    cosine, n > D:         f = m

with W = `lr_warmup_steps`, D = `lr_decay_steps` (default `max_steps`), m = `lr_min_ratio`.
The scheduler steps once per version, after all of its `minibatches` optimizer steps, so the
minibatches of one version share one lr. `LambdaLR` counts from 0: after s versions its
epoch is s and the next update is n = s + 1.

Resuming continues the curve: the checkpoint holds the scheduler's position (its step count)
and the optimizer's state (trainer/checkpoint.py). The hyperparameters come from the config:
the curve's shape (W, D, m), the peak lr, betas, eps and weight decay. Unchanged, the resumed
run continues exactly; a changed one applies from the resumed update on (the lr of update n is
then the new peak times f(n)), and the trainer logs the change as a warning.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

Schedule = Literal["constant", "cosine"]


def lr_factor(
    n: int, schedule: Schedule, warmup_steps: int = 0, decay_steps: int | None = None, min_ratio: float = 0.0
) -> float:
    """f(n), the multiplier of the configured lr for update n ≥ 1 (module docstring)."""
    if n <= warmup_steps:
        return n / warmup_steps
    if schedule == "constant":
        return 1.0
    if decay_steps is None or decay_steps <= warmup_steps:
        raise ValueError(f"cosine decay needs decay_steps > warmup_steps: {decay_steps}, {warmup_steps}")
    progress = min((n - warmup_steps) / (decay_steps - warmup_steps), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    min_ratio: float = 0.0,
) -> LambdaLR:
    """A `LambdaLR` over `optimizer` following `lr_factor`; sets the lr of update 1 at once."""
    if schedule == "cosine":  # refuse a bad horizon now, not at the first step past warmup
        lr_factor(warmup_steps + 1, schedule, warmup_steps, decay_steps, min_ratio)

    def factor(epoch: int) -> float:  # a plain function: LambdaLR's state_dict then holds no callable
        return lr_factor(epoch + 1, schedule, warmup_steps, decay_steps, min_ratio)

    return LambdaLR(optimizer, factor)
