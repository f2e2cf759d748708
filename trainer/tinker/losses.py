"""Tinker's built-in losses, as the Tinker docs define them (tinker-docs.thinkingmachines.ai
/tinker/losses/{cross-entropy,importance-sampling,ppo,cispo,dro}, read for tinker 0.38.0; the
defaults of ppo's and cispo's thresholds from tinker-cookbook's tutorials/202_loss_functions.py).

Every loss is a sum over tokens (and over the data of a call): no mean, no mask beyond the
inputs themselves. Position i of a datum predicts `target_tokens[i]`; `logprobs` among the
inputs are the sampler's (q), the learner's (p_θ) come from the model. With
r = exp(log p_θ − log q) and A the advantages, per token:

* `cross_entropy`: −log p_θ · weights (weights of any sign: the SDK's forward_backward_custom
  sends −∂C/∂logprobs as weights)
* `importance_sampling`: −r · A
* `ppo`: −min(r · A, clip(r, clip_low_threshold, clip_high_threshold) · A), thresholds 0.8, 1.2
* `cispo`: −sg(clip(r, clip_low_threshold, clip_high_threshold)) · log p_θ · A, thresholds 0, 4
* `dro`: −(log p_θ · A − ½ β (log p_θ − log q)²); β has no documented default: it is required

Why not trainer/losses.py's `policy_loss`: its thresholds are relative (1 ± ε), its CISPO clips
above only, it corrects π_old against the behaviour policy and it averages; these are Tinker's
definitions. tests/integration/trainer/test_tinker_gradients.py pins them to the trainer's step
where the two define the same objective. Shared with it: `MAX_LOG_RATIO`, the one deviation from
the docs' formulas (r is exp of the log ratio clamped to ±20, whose gradient is 0 beyond).

Shapes: logprobs and every input [B, T] (T: the longest datum of the micro-batch, times K for
cross_entropy's top-K targets); `present` [B, T] bool, False on padding, whose values are
finite (the collate writes 0 there, the inputs are checked finite) and never reach a sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from asyncrl.trainer.losses import MAX_LOG_RATIO


@dataclass(frozen=True)
class LossSpec:
    """What a loss reads: its `loss_fn_inputs` (all float32 but target_tokens, all of one length
    per datum) and its `loss_fn_config` keys with their defaults (None: required)."""

    inputs: tuple[str, ...]
    config: dict[str, float | None] = field(default_factory=dict)
    top_k: bool = False  # target_tokens (and weights) may be [N, K]: K targets per position


def _ratio(logprobs: Tensor, sampling: Tensor) -> Tensor:
    return (logprobs - sampling).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def cross_entropy(lp: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    return -lp * x["weights"]


def importance_sampling(lp: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    return -_ratio(lp, x["logprobs"]) * x["advantages"]


def ppo(lp: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    r, a = _ratio(lp, x["logprobs"]), x["advantages"]
    clipped = r.clamp(c["clip_low_threshold"], c["clip_high_threshold"])
    return -torch.min(r * a, clipped * a)


def cispo(lp: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    weight = _ratio(lp, x["logprobs"]).clamp(c["clip_low_threshold"], c["clip_high_threshold"]).detach()
    return -weight * lp * x["advantages"]


def dro(lp: Tensor, x: dict[str, Tensor], c: dict[str, float]) -> Tensor:
    quadratic = (lp - x["logprobs"]) ** 2
    return -(lp * x["advantages"] - 0.5 * c["beta"] * quadratic)


RL_INPUTS = ("target_tokens", "logprobs", "advantages")
PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CISPO_CLIP = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}

LOSSES: dict[str, tuple[LossSpec, Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]]] = {
    "cross_entropy": (LossSpec(("target_tokens", "weights"), top_k=True), cross_entropy),
    "importance_sampling": (LossSpec(RL_INPUTS), importance_sampling),
    "ppo": (LossSpec(RL_INPUTS, PPO_CLIP), ppo),
    "cispo": (LossSpec(RL_INPUTS, CISPO_CLIP), cispo),
    "dro": (LossSpec(RL_INPUTS, {"beta": None}), dro),
}


def elementwise_loss(
    name: str, logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float], present: Tensor
) -> Tensor:
    """Per-token loss [B, T] of loss `name` (0 on padding); the call's loss is its sum."""
    token_loss = LOSSES[name][1](logprobs, inputs, config)
    return torch.where(present, token_loss, torch.zeros_like(token_loss))
