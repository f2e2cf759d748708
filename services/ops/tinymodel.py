"""Tiny HF-format causal LMs with a character-level tokenizer, built locally (nothing is
downloaded). Used by the CPU demo, the tests and the benchmarks.

`build_tiny_model(dir)` writes `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json`; `AutoModelForCausalLM` and
`AutoTokenizer` load the directory like any hub model.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_CHARS = string.ascii_lowercase + string.digits + " +-*/=>?.,:()<>\n"


def char_vocab(chars: str = DEFAULT_CHARS) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(chars):
        if ch not in vocab:
            vocab[ch] = len(vocab)
    return vocab


def _byte_level_char(ch: str) -> str:
    """GPT-2's byte→unicode map for one ASCII character (space → 'Ġ', newline → 'Ċ')."""
    b = ord(ch)
    if ord("!") <= b <= ord("~"):
        return ch
    # bytes outside the printable ranges map to U+0100 + their rank among such bytes
    outside = [
        x for x in range(256) if not (ord("!") <= x <= ord("~") or 0xA1 <= x <= 0xAC or 0xAE <= x <= 0xFF)
    ]
    return chr(256 + outside.index(b))


def build_char_tokenizer(out_dir: str | Path, chars: str = DEFAULT_CHARS, model_max_length: int = 512):
    """A character-level tokenizer saved as a real tokenizer.json.

    It is a byte-level BPE with no merges, built exactly as transformers' Qwen2Tokenizer
    rebuilds one (NFC, Qwen2's split regex, ByteLevel, no BOS): AutoTokenizer maps a qwen2
    model to that class, which keeps only the vocabulary of tokenizer.json, so any other
    construction would tokenize differently depending on how it is loaded.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if any(ord(c) > 126 or (ord(c) < 32 and c != "\n") for c in chars):
        raise ValueError("tiny tokenizer characters must be printable ASCII or newline")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(_byte_level_char(ch), len(vocab))
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<pad>",
        model_max_length=model_max_length,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    chars: str = DEFAULT_CHARS,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    arch: str = "qwen2",
):
    """Write a randomly initialised Qwen2 (or Llama) model and its tokenizer to `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(out_dir, chars, model_max_length=max_position_embeddings)
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "asyncrl_tiny.json").write_text(json.dumps({"chars": chars, "seed": seed}))
    return model, tokenizer
