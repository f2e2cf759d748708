"""Process group, model loading and FSDP2 sharding for the trainer.

Any HF causal LM in a local directory (config.json + safetensors) loads; nothing is fetched
from a hub. The model is built on the meta device, sharded with `fully_shard` (one unit per
decoder layer plus the root), materialised with `to_empty`, and filled from a full state dict
that rank 0 reads and broadcasts, so no rank ever holds more than its shard plus one copy on
rank 0. Non-persistent buffers (rotary `inv_freq`) are not in any state dict and come out of
`to_empty` as garbage: they are rebuilt from the config afterwards.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.trainer.logprobs import install as install_logprobs

if TYPE_CHECKING:
    from asyncrl.trainer.config import LoraSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with native bf16 matmul


def resolve_mixed_precision(setting: str, device: torch.device, cpu_flags: set[str] | None = None) -> str:
    """The FSDP2 compute dtype for `mixed_precision = "auto"`: bfloat16 on CUDA and on a CPU with
    native bf16 matmul (AMX or AVX512-BF16 among `cpu_flags`, default /proc/cpuinfo's), float32
    elsewhere. Without them oneDNN emulates bf16: a 2048x576x1536 matmul ran at 1.3 GFLOP/s in bf16
    against 76 in fp32 on an AVX2-only EPYC core, so bf16 there makes every step ~60x slower."""
    if setting != "auto":
        return setting
    if device.type == "cuda":
        return "bfloat16"
    if cpu_flags is None:
        try:
            cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
        except OSError:  # not Linux: trust oneDNN's own check
            return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    return "bfloat16" if cpu_flags.intersection(CPU_BF16_FLAGS) else "float32"


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """Join the torchrun group (env:// rendezvous): NCCL on GPU, gloo on CPU.

    Works without torchrun too (a world of one on a free local port), for tests and tools.
    """
    from asyncrl.buffer.server import free_port

    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def _rebuild_nonpersistent_buffers(model: nn.Module, device: torch.device) -> int:
    """Recompute rotary `inv_freq` (and siblings) after `to_empty`; returns modules fixed."""
    fixed = 0
    for module in model.modules():
        if not hasattr(module, "inv_freq") or not hasattr(module, "config"):
            continue
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for name, buf in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buf)
        fixed += 1
    return fixed


def load_full_state_dict(model_path: str | Path, random_init: bool, seed: int) -> dict[str, torch.Tensor]:
    """Rank 0's full (unsharded) CPU state dict: from the directory's safetensors, or a seeded
    fresh initialisation of its config.json when `random_init`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_path)
    if random_init:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).state_dict()
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def build_model(
    model_path: str | Path,
    d: Dist,
    *,
    random_init: bool = False,
    seed: int = 0,
    mixed_precision: str = "float32",
    reshard_after_forward: bool = True,
    trainable: bool = True,
    activation_checkpointing: bool = False,
    packing: bool = False,
    lora: LoraSettings | None = None,
) -> nn.Module:
    """Meta-init → (activation checkpointing per decoder layer) → fully_shard per decoder layer
    and root (not on a world of one in fp32: nothing to shard or cast, and FSDP2's hooks and
    DTensor optimizer steps cost ~10% of a small model's step; checkpoints reshard either way)
    → to_empty → broadcast weights from rank 0 → the log-prob method installed
    (trainer/logprobs.py: `token_logprobs` runs through it with the root's FSDP hooks).

    Resharding after forward (`reshard_after_forward`: the decoder layers') frees each layer's
    gathered parameters until its backward gathers them again. A trainable model keeps the two
    units its backward starts with gathered instead: the root (embeddings, final norm, LM head:
    with a 151,936-token vocabulary most of a small model's parameters) and the last decoder
    layer; resharding them would only all-gather them again at once (FSDP2's own default for
    the root; torchtitan's for the last layer). Their memory is the same: the root is held for
    the whole forward anyway. A frozen model (the reference model: no backward to reshard it)
    reshards everything.

    Activation checkpointing keeps only each decoder layer's input in forward and recomputes the
    layer in backward (non-reentrant `torch.utils.checkpoint` through transformers' per-layer
    hook; under FSDP2 the recompute runs inside the layer's pre-backward all-gather).

    `packing`: micro-batches are packed rows (trainer/batch.py); attention then follows the
    samples' position ids (`packed_attention`).

    `lora` (enabled): the model is a peft `PeftModel` whose LoRA adapters alone train; the base
    is frozen before sharding and loaded as above, the adapters start at peft's initialisation
    drawn with `seed` (trainer/lora.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if packing:
        packed_attention(model, d.device, DTYPES[mixed_precision])
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None:
        from asyncrl.trainer.lora import wrap

        model = wrap(model, lora, _decoder_layers(model))
    sharded = d.world > 1 or mixed_precision != "float32"
    if sharded:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)
        layers = _decoder_layers(model)
        for i, layer in enumerate(layers):
            fully_shard(
                layer,
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward and not (trainable and i == len(layers) - 1),
            )
        fully_shard(model, mp_policy=mp, reshard_after_forward=not trainable)
    model.to_empty(device=d.device)
    if not sharded and getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty made the tied head a parameter of its own
    _rebuild_nonpersistent_buffers(model, d.device)
    full = load_full_state_dict(model_path, random_init, seed) if d.is_main else {}
    if lora is not None and d.is_main:
        from asyncrl.trainer.lora import initial_state

        full = initial_state(model, full, seed)
    for alias, canonical in tied_aliases(model).items():
        if d.is_main and alias not in full:  # HF writes a tied weight once
            full[alias] = full[canonical]
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    del full
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    install_logprobs(model)
    return model


def packed_attention(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Attention that never crosses the samples of a packed row: varlen flash attention on CUDA
    in bf16/fp16 when flash-attn is installed, else per-sample SDPA segments (trainer/attention.py)."""
    import importlib.util

    flash = dtype in (torch.bfloat16, torch.float16) and importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda" and flash:
        model.set_attn_implementation("flash_attention_2")
    else:
        from asyncrl.trainer.attention import use_segment_attention

        use_segment_attention(model)
    return model.config._attn_implementation


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in backward instead of keeping its activations."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def share_cores(model: nn.Module, cores) -> None:
    """Core sharing (services/runtime/cores.py): re-claim threads at each decoder layer's
    forward and at the start of its backward (a hook on the layer's output gradient), so the
    engine waits at most about one layer's compute for a core it takes back. Both run on the
    thread that computes: autograd runs a CPU graph's backward on the thread that called it."""

    def backward_checkpoint(grad):
        cores.work()

    def forward_pre(module, args):
        cores.work()

    def forward_post(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(backward_checkpoint)

    for layer in _decoder_layers(model):
        layer.register_forward_pre_hook(forward_pre)
        layer.register_forward_hook(forward_post)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the FSDP units): the largest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers to shard")
    return list(max(lists, key=len))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank calls; rank 0 gets the full CPU state dict, the others {}.

    Tied weights appear once (under the input embedding's name), as HF writes them. A model that
    is not sharded (a world of one) has nothing to gather: its own tensors are returned (on the
    CPU: the live parameters themselves), ~30× faster than the gathering API on the demo's model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if (not dist.is_initialized() or dist.get_world_size() == 1) and not any(
        hasattr(p, "to_local") for p in model.parameters()
    ):
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for alias in tied_aliases(model):
        state.pop(alias, None)
    return state


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: first name} for parameters registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def broadcast_from_main(d: Dist, t: torch.Tensor) -> None:
    """In-place broadcast of a CPU tensor from rank 0 (through the device under NCCL)."""
    if d.backend == "nccl":
        moved = t.to(d.device)
        dist.broadcast(moved, 0)
        t.copy_(moved.cpu())
    else:
        dist.broadcast(t, 0)
