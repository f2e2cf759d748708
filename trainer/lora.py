"""LoRA on the policy (`[trainer.lora]`): only low-rank adapters train, and only they are
published.

Why peft: a published adapter is read by SGLang's `/load_lora_adapter` and by
`PeftModel.from_pretrained`, both of which expect peft's format: its `adapter_config.json`, its
key names (`base_model.model.<module>.lora_A.weight`) and its scaling. The trainer therefore
uses peft's own LoRA layers and its own key rewriting (`get_peft_model_state_dict`) instead of
keeping a copy of that format in step with two upstreams. What peft does not know about stays
the trainer's: sharding, loading, initialisation and the reference forward (below).

Build (`trainer/model.py` `build_model`): the meta model is wrapped (`wrap`) before sharding,
so each decoder layer's FSDP unit holds its adapters beside its frozen base weights. The base
is frozen before `fully_shard`: FSDP2 all-gathers it for the forward and backward compute,
never reduce-scatters a gradient for it, the optimizer never holds it, and checkpoints and
publishing leave it out (only adapter parameters are ever gathered whole). Rank 0 builds the
full state dict (`initial_state`): the base weights under the wrapped names and the adapters'
starting values, peft's default initialisation (A kaiming-uniform with a = √5, drawn from a
generator seeded with `seed`; B zero), broadcast like any other weight. With B = 0 the wrapped
model starts as the base model exactly, so the base is the initial policy: the reference of the
KL penalty is the policy's own forward with its adapters off (`adapters_off`), no second model.

Publishing (`adapter_state_dict`, `adapter_config`): a collective gather of the adapter
parameters alone; rank 0 gets them under peft's published names, and the `adapter_config.json`
to write beside them. rsLoRA is published folded into α (α·√r with `use_rslora` false): the same
scale for peft, and for SGLang, which computes α/r whatever `use_rslora` says.

Limits: adapters go on Linear layers inside the decoder layers (`wrap` refuses others: the LM
head's log-probs are computed from its weight, trainer/logprobs.py); no adapter bias; peft's
default initialisation only; `dropout` acts in every trainer forward, the π_old recompute too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from asyncrl.trainer.config import LoraSettings

ADAPTER = "default"  # peft's name for the one adapter inside the trainer; published keys drop it
WRAPPED_PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's names
BASE_LAYER = ".base_layer."  # where a LoRA layer keeps the Linear it adapts
ADAPTER_PARTS = (".lora_A.", ".lora_B.")  # the names of adapter parameters contain one of these
KAIMING_A = math.sqrt(5)  # peft's (and nn.Linear's) kaiming-uniform slope for A: bound 1/√fan_in


def lora_config(settings: LoraSettings):
    """peft's LoraConfig for `settings` (bias "none", peft's default initialisation)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        use_rslora=settings.rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: nn.Module, settings: LoraSettings, decoder_layers: list[nn.Module]) -> nn.Module:
    """The PeftModel around `model` (on any device, the meta device included: the adapters are
    created there too and filled later). Only adapter parameters require grad. Raises if an
    adapter would sit outside `decoder_layers` (the FSDP units, and what SGLang adapts)."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside = {id(m) for layer in decoder_layers for m in layer.modules()}
    wrapped = get_peft_model(model, lora_config(settings), adapter_name=ADAPTER)
    outside = [
        name
        for name, m in wrapped.named_modules()
        if isinstance(m, BaseTunerLayer) and id(m.get_base_layer()) not in inside
    ]
    if outside:
        raise ValueError(
            f"[trainer.lora] target_modules adapt {outside}: adapters go on Linear layers inside the "
            "decoder layers only"
        )
    return wrapped


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def base_name(name: str) -> str:
    """The unwrapped model's name of a wrapped model's base parameter or buffer."""
    return name.removeprefix(WRAPPED_PREFIX).replace(BASE_LAYER, ".")


def initial_state(model: nn.Module, base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Rank 0: the wrapped model's full state dict: `base` (the unwrapped model's, by name) under
    the wrapped names and every adapter's starting value (A kaiming-uniform from a generator
    seeded with `seed`, in parameter order; B zero). A name missing from `base` (a tied alias)
    is left for the caller to fill."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name:
            a = torch.empty(tensor.shape, dtype=torch.float32)
            state[name] = nn.init.kaiming_uniform_(a, a=KAIMING_A, generator=generator)
        elif ".lora_B." in name:
            state[name] = torch.zeros(tensor.shape, dtype=torch.float32)
        elif base_name(name) in base:
            state[name] = base[base_name(name)]
    return state


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer alone inside the block: the base model's forward
    through the policy's own (sharded) weights.

    peft's `PeftModel.disable_adapter()` does this too, but it also sets `requires_grad` off on
    the adapter parameters and back on at exit, on whichever parameter objects the modules hold
    at that moment; under FSDP2 a unit holds its sharded or its all-gathered parameters depending
    on where it is in its forward and backward, so a flag could come back on a different tensor
    than it went off on (and a parameter left frozen drops out of the checkpoint). This flips
    only the layers' switch (peft's `_disable_adapters`, which its `disable_adapters` property
    reads in every forward; peft is pinned for it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA layers to switch off")
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, state in zip(layers, before):
            m._disable_adapters = state


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls; rank 0 gets the adapter tensors whole, on the CPU, under the
    names peft publishes (`base_model.model.<module>.lora_A.weight`); the others {}. Only the
    trainable (adapter) parameters are gathered, never the frozen base."""
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    main = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, param in model.named_parameters():  # the same order on every rank
        if not param.requires_grad:
            continue
        whole = param.full_tensor() if isinstance(param, DTensor) else param  # all-gather when sharded
        if main:
            state[name] = whole.detach().cpu()
    if not main:
        return {}
    return get_peft_model_state_dict(
        model, state_dict=state, adapter_name=ADAPTER, save_embedding_layers=False
    )


def adapter_config(model: nn.Module, base_model_path: str) -> dict:
    """The `adapter_config.json` of the model's adapter as peft writes it (sets as sorted lists),
    for `base_model_path`, with rsLoRA folded into α (module docstring)."""
    config = model.peft_config[ADAPTER].to_dict()
    out = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    out["base_model_name_or_path"] = str(base_model_path)
    out["inference_mode"] = True
    if out.get("use_rslora"):
        out["lora_alpha"] = out["lora_alpha"] * math.sqrt(out["r"])
        out["use_rslora"] = False
    return out
