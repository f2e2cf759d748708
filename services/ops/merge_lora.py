"""`asyncrl model merge-lora ADAPTER --out DIR [--base DIR]`: a LoRA run's published adapter
(a PEFT adapter directory, trainer/lora.py) merged into its base model, written as an ordinary
HF checkpoint directory that every service and `AutoModelForCausalLM` read without peft.

The merge is peft's own (`PeftModel.from_pretrained(base).merge_and_unload()`: W + scale·B·A per
adapted layer), computed in fp32 and cast to `dtype` once at the end. The base is the adapter
config's `base_model_name_or_path` (the trainer's `model_path`) unless `--base` names another
copy of it. The base directory's other files (tokenizer, chat template) are copied beside the
merged weights. Nothing is fetched from a network.

Limits: the base must be the model the adapter was trained on (peft checks the shapes, not the
values); `out` must not exist yet.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.services.ops.gguf import ConversionError
from asyncrl.services.transport.weights.filesystem import ADAPTER_CONFIG_FILE, ADAPTER_FILE, is_source_weights

DTYPES = ("float32", "bfloat16", "float16")


def merge_lora(
    adapter_dir: Path, out_dir: Path, base_dir: Path | None = None, dtype: str = "float32"
) -> Path:
    """Write base + adapter, merged, to `out_dir`; returns it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    config_path = adapter_dir / ADAPTER_CONFIG_FILE
    if not config_path.is_file() or not (adapter_dir / ADAPTER_FILE).is_file():
        raise ConversionError(
            f"{adapter_dir} is not a PEFT adapter directory ({ADAPTER_CONFIG_FILE}, {ADAPTER_FILE})"
        )
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{config_path} is a {config.get('peft_type')} adapter, not LoRA")
    base_dir = Path(base_dir or config.get("base_model_name_or_path") or "")
    if not (base_dir / "config.json").is_file():
        raise ConversionError(f"no base model at {str(base_dir)!r}: pass --base DIR")
    if out_dir.exists():
        raise ConversionError(f"{out_dir} exists: choose a new directory")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    for f in base_dir.iterdir():  # the tokenizer and the rest, not the base's weights
        if f.is_file() and not is_source_weights(f.name) and not (out_dir / f.name).exists():
            shutil.copy2(f, out_dir / f.name)
    return out_dir
