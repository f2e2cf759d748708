"""One Tinker training model: the SDK's `lora_config` mapped onto the trainer's LoRA, the model
built by `build_model` (trainer/model.py), its own AdamW, and the frozen base shared.

`lora_config` (tinker.types.LoraConfig of 0.38.0): `rank` is the adapters' r; `train_attn`
adapts q/k/v/o_proj and `train_mlp` gate/up/down_proj of every decoder layer (the Linear names
the engines adapt, services/engine/config.py); `seed` draws A (peft's initialisation, B = 0,
trainer/lora.py). α is `TinkerSettings.lora_alpha` (32, what Tinker's adapters carry:
tinker-cookbook weights/README.md). `train_unembed` (the SDK's default True) asks for an
adapter on the LM head: the trainer computes log-probs from the head's weight and the engines
refuse such adapters, so it is refused, unless `unembed_without_adapter` is set, and then the
model trains none and reports `train_unembed: False`.

Sharing the base: every model built on one base model points its frozen parameters at the first
one's (`share_base`), by their unwrapped names (trainer/lora.py `base_name`), so N models cost
one base plus N sets of adapters and optimizer states; the base is never written (frozen, and
no optimizer holds it), so no model can change another's. Only unsharded models share (a world
of one in fp32: `build_model` does not wrap them in FSDP); an FSDP2 model's parameters are
DTensors FSDP manages, and it keeps its own copy. A model is still built whole first (the base
read from disk, ~1 s for SmolLM2-135M) and its copy dropped at once.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl.trainer.tinker.errors import InvalidInputError, UnsupportedError

if TYPE_CHECKING:
    from asyncrl.trainer.config import LoraSettings
    from asyncrl.trainer.publish import DiskPublisher

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_KEYS = ("rank", "seed", "train_mlp", "train_attn", "train_unembed")
TINKER_BETAS, TINKER_EPS = (0.9, 0.95), 1e-12  # tinker.types.AdamParams' defaults


@dataclass(frozen=True)
class LoraRequest:
    """A model's LoRA as created (the seed drawn when the client gave none)."""

    rank: int
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def targets(self) -> list[str]:
        return [*(ATTENTION if self.train_attn else ()), *(MLP if self.train_mlp else ())]


def lora_request(
    lora: dict | None, seed: int | None, max_rank: int, unembed_without_adapter: bool
) -> LoraRequest:
    """Check the SDK's lora_config; `seed` (create_model's) is used when lora_config has none."""
    if lora is None:
        raise UnsupportedError(
            "full fine-tuning (create_model without lora_config) is not supported: use "
            "create_lora_training_client"
        )
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise InvalidInputError(f"lora_config keys {unknown} are unknown; it takes {list(LORA_KEYS)}")
    rank = lora.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidInputError(f"lora_config rank must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise UnsupportedError(f"lora_config rank {rank} is above this service's max_lora_rank {max_rank}")
    flags = {k: lora.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidInputError(f"lora_config {key} must be true or false, not {value!r}")
    if flags["train_unembed"]:
        if not unembed_without_adapter:
            raise UnsupportedError(
                "lora_config train_unembed=True (LoRA on the unembedding, lm_head) is not supported: "
                "the trainer computes log-probs from the head's weight and the engines refuse lm_head "
                "adapters; pass train_unembed=False"
            )
        flags["train_unembed"] = False  # accepted without it, and said so in info()
    if not (flags["train_mlp"] or flags["train_attn"]):
        raise UnsupportedError("lora_config trains nothing: set train_attn or train_mlp")
    chosen = lora.get("seed", seed)
    if chosen is None:
        chosen = secrets.randbits(31)
    if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 0:
        raise InvalidInputError(f"lora_config seed must be a non-negative integer, not {chosen!r}")
    return LoraRequest(rank=rank, seed=chosen, **flags)


def lora_settings(req: LoraRequest, alpha: float) -> LoraSettings:
    from asyncrl.trainer.config import LoraSettings

    return LoraSettings(rank=req.rank, alpha=alpha, target_modules=req.targets())


def frozen_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{unwrapped name: parameter} of the frozen (base) parameters, tied aliases included."""
    from asyncrl.trainer.lora import base_name

    return {
        base_name(name): p
        for name, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }


def share_base(model: nn.Module, shared: dict[str, nn.Parameter]) -> int:
    """Point every frozen parameter of `model` at `shared`'s of the same unwrapped name (its own
    copy is freed); returns how many were replaced. Refuses a parameter `shared` lacks or whose
    shape differs: the two models would not be built on one base."""
    from asyncrl.trainer.lora import base_name

    replaced = 0
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad:
                continue
            key = base_name(f"{module_name}.{name}" if module_name else name)
            source = shared.get(key)
            if source is None or source.shape != param.shape:
                raise RuntimeError(f"base parameter {key} is not the shared base's: cannot share it")
            setattr(module, name, source)
            replaced += 1
    return replaced


def is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


def fresh_adam_state(optimizer: torch.optim.AdamW) -> None:
    """Every parameter's AdamW state as a first step creates it (step 0, zero moments), written
    out now: a checkpoint then always holds the whole state, and torch's `get_state_dict` never
    initialises it itself (its zero-lr step would leave step = 1, changing the next update's
    bias correction)."""
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


@dataclass
class TinkerModel:
    """One client's model: adapters (in `module`), optimizer state, accumulated gradients (the
    adapters' `.grad`) and counters."""

    model_id: str
    base_model: str
    base_path: str
    lora: LoraRequest
    module: nn.Module
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR  # constant 1: the checkpointer's interface needs one
    publisher: DiskPublisher
    vocab: int
    pad_id: int
    shares_base: bool
    step: int = 0  # optim_steps applied
    sampler_version: int = 0  # the last save_for_sampler's version
    counters: dict[str, float] = field(default_factory=dict)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def count(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value
