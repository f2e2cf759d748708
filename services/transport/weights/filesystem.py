"""The on-disk layout of published weights, shared by the writer (trainer/publish.py) and the
readers (the engine's `/update_weights_from_disk`). The contract is services/transport/weights'
docstring; this module names the directories and files."""

from __future__ import annotations

import re
from pathlib import Path

MODEL_FILE = "model.safetensors"  # the tensors of one version, written whole by the sender
# A LoRA version (`WeightsInfo.kind == "lora"`) is a PEFT adapter directory: these two files only,
# the config (peft's LoraConfig as peft writes it: r, lora_alpha, target_modules) and the tensors.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"  # the lora_A / lora_B tensors under peft's key names
WEIGHTS_GLOB = "*.safetensors"  # what a receiver loads from a directory (any HF checkpoint's shards)
# files of the source checkpoint that hold tensors: a published directory has MODEL_FILE instead
SOURCE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SOURCE_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
VERSION_DIR = re.compile(r"v(\d+)(?:-e(\d+))?")


def version_dir_name(version: int, epoch: int = 0) -> str:
    """`v00000466` in epoch 0, `v00000466-e2` in epoch 2: a version of another history never
    overwrites this one's directory."""
    return f"v{version:08d}" if epoch == 0 else f"v{version:08d}-e{epoch}"


def published_versions(root: Path) -> list[tuple[tuple[int, int], Path]]:
    """((epoch, version), directory) of every version directory under `root`, in publication
    order (temporary directories being written are not listed)."""
    found = []
    for path in root.glob("v*"):
        named = VERSION_DIR.fullmatch(path.name)
        if named:
            found.append(((int(named[2] or 0), int(named[1])), path))
    return sorted(found)


def is_source_weights(name: str) -> bool:
    """A file of the source checkpoint that a published directory replaces with MODEL_FILE."""
    return name.endswith(SOURCE_WEIGHT_SUFFIXES) or name in SOURCE_WEIGHT_INDEXES


def file_metadata(version: int, epoch: int) -> dict[str, str]:
    """The safetensors header metadata of MODEL_FILE (or ADAPTER_FILE): which version of which
    history it holds."""
    return {"format": "pt", "asyncrl_version": str(version), "asyncrl_epoch": str(epoch)}
