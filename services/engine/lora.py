"""LoRA adapters in the reference engine: a PEFT adapter directory read and checked against the
model (`read_adapter`), and adapters applied per row of a batched forward (`applied`).

An adapter adds `scale · (x @ Aᵀ) @ Bᵀ` to the output of each linear module it targets, with
`scale = lora_alpha / r`, or `lora_alpha / √r` when its config sets `use_rslora` (PEFT's
`LoraLayer.update_layer`). Rows of one forward may name different adapters, or none: each
adapter's delta is computed on its own rows only and added to them. A forward whose rows name
no adapter runs the model as it is: the hooks that add the deltas exist only for the duration
of a forward that needs them.

Accepted: PEFT `LORA` adapters whose weights target the linear layers of the decoder layers
(`config.LORA_TARGET_MODULES`), within the engine's `max_lora_rank` and `lora_target_modules`.
Refused, with the reason: any other PEFT type, DoRA and the other LoRA variants, biases,
per-module ranks or alphas (`rank_pattern`, `alpha_pattern`), `modules_to_save`, added
tokens, embeddings or `lm_head`, shapes that are not the model's.

Differs from SGLang 0.5.23, which scales by `lora_alpha / r` whatever `use_rslora` says
(`sglang/srt/lora/lora.py`, `LoRAAdapter.__init__`): an rsLoRA adapter samples the same here
as under PEFT, and differently on SGLang. Not provided: a memory pool (an adapter's tensors
live as long as the adapter is loaded), loading from tensors, adapters from a model hub.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from asyncrl.services.engine.config import LORA_STACKED, LORA_TARGET_MODULES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADDED_TOKENS = "added_tokens.json"
PEFT_PREFIX = "base_model.model."  # PEFT's save_pretrained puts the model's own names under this
# Larger than any real adapter's config: a config past it is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20
# adapter_config.json keys that change what an adapter computes beyond A, B and the scale, and the
# value that means "not used". An adapter setting any other value is refused, not approximated.
UNSUPPORTED_IF_SET = {
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
}


class AdapterError(ValueError):
    """An adapter that cannot be loaded; the message says why (it goes back to the caller)."""


@dataclass(frozen=True, eq=False)  # identity: two loads of one directory are two adapters
class LoraAdapter:
    """A loaded adapter: per target module (the model's name for it), A [r, in] and B [out, r]
    on the model's device and dtype, with `scale` folded into B."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    pinned: bool = False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def resolve_adapter_dir(root: str, path: str) -> str | None:
    """The real path of adapter directory `path` when it lies inside `root` (both resolved:
    symlinks, '..') and holds an adapter config and weights that resolve inside `root` too (an
    added-tokens file as well, where there is one); else None. The same rule as weight
    directories (`updates.resolve_weights_dir`)."""
    if not os.path.isabs(path):
        return None
    try:
        real_root, real = os.path.realpath(root), os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root or not os.path.isdir(real):
            return None
        files = [os.path.join(real, f) for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
        if not all(os.path.isfile(f) for f in files):
            return None
        added = os.path.join(real, ADDED_TOKENS)
        if os.path.lexists(added):
            files.append(added)
        inside = [os.path.commonpath([real_root, os.path.realpath(f)]) == real_root for f in files]
    except (OSError, ValueError):  # a NUL byte in the path, an unreadable directory
        return None
    return real if all(inside) else None


def lora_scale(config: dict) -> float:
    """PEFT's scaling of the adapter's update: lora_alpha / r, or lora_alpha / √r with rsLoRA."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's linear modules an adapter may target (`LORA_TARGET_MODULES`), by full name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGET_MODULES
    }


def read_adapter(
    name: str,
    path: str,
    *,
    real_path: str,
    linears: dict[str, nn.Linear],
    max_rank: int,
    allowed: frozenset[str],
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device,
    pinned: bool = False,
) -> LoraAdapter:
    """Read the PEFT adapter directory `real_path` (`path` as the caller named it, confined by
    `resolve_adapter_dir`) and check it against the model's `linears` (`target_linears`), the
    engine's `max_rank` and its `allowed` stacked target names (`EngineSettings.lora_targets`).
    Raises `AdapterError` with the reason."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_config(name, real_path, vocab_size)
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the engine's max_lora_rank {max_rank}"
        )
    try:
        tensors = load_file(os.path.join(real_path, ADAPTER_WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"cannot read {ADAPTER_WEIGHTS} of LoRA adapter {name}: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    other: list[str] = []  # full weights saved along (embeddings, modules_to_save): not applied here
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind in ("A.weight", "B.weight"):
            pairs.setdefault(module, {})[kind[0]] = tensor
        else:
            other.append(key)
    unknown = sorted(m for m in pairs if m not in linears)
    if unknown:
        raise AdapterError(
            f"LoRA adapter {name} targets modules the engine cannot adapt in this model: {unknown[:5]} "
            f"(only the linear layers {', '.join(LORA_TARGET_MODULES)} of its decoder layers)"
        )
    if other:
        raise AdapterError(
            f"LoRA adapter {name} has tensors that are not lora_A/lora_B weights: {sorted(other)[:5]}"
        )
    if not pairs:
        raise AdapterError(f"LoRA adapter {name} has no lora_A/lora_B weights")
    outside = sorted(
        {LORA_STACKED.get(leaf, leaf) for leaf in (m.rsplit(".", 1)[-1] for m in pairs)} - allowed
    )
    if outside:
        raise AdapterError(
            f"LoRA adapter {name} targets {outside}, not in the engine's lora_target_modules {sorted(allowed)}"
        )
    scale = lora_scale(config)
    weights = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name}: {module} has lora_{''.join(pair)} without its pair")
        a, b, linear = pair["A"], pair["B"], linears[module]
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"LoRA adapter {name}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"expected {want_a} and {want_b} (rank {rank} on this model)"
            )
        # The scale folded into B once, here: a forward then does two matmuls per module.
        weights[module] = (a.to(device, dtype), (b.double() * scale).to(device, dtype))
    return LoraAdapter(name=name, path=path, rank=rank, scale=scale, weights=weights, pinned=pinned)


def _read_config(name: str, path: str, vocab_size: int) -> dict:
    config_file = os.path.join(path, ADAPTER_CONFIG)
    try:
        if os.path.getsize(config_file) > MAX_CONFIG_BYTES:
            raise AdapterError(f"{ADAPTER_CONFIG} of LoRA adapter {name} is over {MAX_CONFIG_BYTES} bytes")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"cannot read {ADAPTER_CONFIG} of LoRA adapter {name}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} of LoRA adapter {name} is not a JSON object")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"LoRA adapter {name} has peft_type {config.get('peft_type')!r}, not 'LORA'")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r <= 0 or type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise AdapterError(
            f"LoRA adapter {name} needs an integer r > 0 and a finite lora_alpha: {r!r}, {alpha!r}"
        )
    if config.get("use_dora"):
        raise AdapterError(
            f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
        )
    set_here = sorted(
        k for k, off in UNSUPPORTED_IF_SET.items() if config.get(k, off) not in (off, None, {}, [], False)
    )
    if set_here:
        raise AdapterError(f"LoRA adapter {name} uses what the reference engine does not apply: {set_here}")
    added = os.path.join(path, ADDED_TOKENS)
    if os.path.exists(added):
        try:
            with open(added, encoding="utf-8") as f:
                ids = list(json.load(f).values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise AdapterError(f"cannot read {ADDED_TOKENS} of LoRA adapter {name}: {exc}") from None
        # SGLang's filter (lora_config.py): ids below the base vocabulary are not added tokens
        if any(not isinstance(i, int) or i >= vocab_size for i in ids):
            raise AdapterError(
                f"Failed to load {name} because LoRA serving currently doesn't support adapters that add "
                "tokens to the vocabulary"
            )
    return config


@contextmanager
def applied(linears: dict[str, nn.Linear], row_adapters: Sequence[LoraAdapter | None]) -> Iterator[None]:
    """Within this block, a forward of the model whose batch row i is `row_adapters[i]`'s adds
    each adapter's update to its own rows (None: the base model). Rows naming no adapter cost
    nothing; a batch naming none installs nothing."""
    groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
    for row, adapter in enumerate(row_adapters):
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(row)
    if not groups:
        yield
        return
    n = len(row_adapters)
    device = next(iter(linears.values())).weight.device
    # per module: (A, B, the adapter's rows or None for every row)
    plan: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
    for adapter, rows in groups.values():
        index = None if len(rows) == n else torch.tensor(rows, device=device)
        for module, (a, b) in adapter.weights.items():
            plan.setdefault(module, []).append((a, b, index))
    handles = [linears[module].register_forward_hook(_adds(updates)) for module, updates in plan.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _adds(updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]):
    """The forward hook of one linear module: its output plus each adapter's update on its rows."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        for a, b, rows in updates:
            if rows is None:
                out = out + (x @ a.T) @ b.T
            else:
                out = out.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out

    return hook
