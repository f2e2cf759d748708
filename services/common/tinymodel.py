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


def build_char_tokenizer(out_dir: str | Path, chars: str = DEFAULT_CHARS, model_max_length: int = 512):
    """A real `tokenizers` WordLevel tokenizer over single characters, saved as tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = char_vocab(chars)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
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
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
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
