"""The model side of the reference engine: a transformers causal LM, a slot KV cache, and
batched prefill / decode forwards over it. Only the scheduler thread calls into this.

KV cache: per layer, K and V tensors of shape [slots, kv_heads, capacity, head_dim]. Each
running request owns one slot; running requests always occupy slots 0..n-1 (a finished
request's slot is refilled by moving the last one in), so a decode step runs on plain views
of the cache, never gathers. Capacity grows by doubling up to the context length.

LoRA (`lora.py`): each row of a prefill or decode may name an adapter; `lora.applied` adds each
adapter's update to its own rows during that forward. A batch that names none runs unchanged.

The model's attention layers see the cache through `_SlotView.update(k, v, layer_idx)` (the
only cache method a transformers decoder calls when it is given position ids and a prepared
4-D mask): a prefill writes positions 0..T-1 of new slots, a decode step writes one token per
slot at that slot's own length. The boolean 4-D mask hides padding and other requests' unused
positions, so rows of different lengths batch together exactly.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass

import torch

from asyncrl.services.engine import lora
from asyncrl.services.transport.weights.filesystem import WEIGHTS_GLOB

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 128


class SlotKVCache:
    def __init__(self, *, layers: int, slots: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        self.max_len = max_len
        self.capacity = min(INITIAL_CAPACITY, max_len)
        shape = (slots, kv_heads, self.capacity, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def ensure(self, length: int) -> None:
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the context length {self.max_len}")
        new = min(max(2 * self.capacity, length), self.max_len)
        for cache in (self.key_cache, self.value_cache):
            for i, old in enumerate(cache):
                grown = old.new_zeros((*old.shape[:2], new, old.shape[3]))
                grown[:, :, : self.capacity] = old
                cache[i] = grown
        self.capacity = new

    def move(self, src: int, dst: int, length: int) -> None:
        for cache in (self.key_cache, self.value_cache):
            for layer in cache:
                layer[dst, :, :length] = layer[src, :, :length]

    def view(self, first_slot: int, n: int, starts: list[int] | None, kv_len: int) -> _SlotView:
        return _SlotView(self, first_slot, n, starts, kv_len)


class _SlotView:
    """What one forward sees: slots [first, first+n); `starts=None` means a prefill from 0."""

    def __init__(self, cache: SlotKVCache, first: int, n: int, starts: list[int] | None, kv_len: int):
        self.cache, self.first, self.slots, self.kv_len = cache, first, n, kv_len
        device = cache.key_cache[0].device
        # One shared start (a prefill from 0, or rows of equal length) writes a plain slice.
        self.same_start = 0 if starts is None else (starts[0] if min(starts) == max(starts) else None)
        if self.same_start is None:
            self.rows = torch.arange(n, device=device)
            self.starts = torch.tensor(starts, device=device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k = self.cache.key_cache[layer_idx][self.first : self.first + self.slots]
        v = self.cache.value_cache[layer_idx][self.first : self.first + self.slots]
        if self.same_start is not None:
            end = self.same_start + key_states.shape[2]
            k[:, :, self.same_start : end] = key_states
            v[:, :, self.same_start : end] = value_states
        else:  # decode, one token per row at its own position
            k[self.rows, :, self.starts] = key_states[:, :, 0]
            v[self.rows, :, self.starts] = value_states[:, :, 0]
        return k[:, :, : self.kv_len], v[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


@dataclass
class ForwardRow:
    """One request of a prefill: its whole token sequence, written to its slot from position 0."""

    token_ids: list[int]
    full_logits: bool = False  # also return the logits of every position (prompt logprobs)
    copied: bool = False  # set by `prefill`: its cache and logits were copied from an identical row's
    adapter: lora.LoraAdapter | None = None  # the LoRA adapter this row runs with (None: the base model)


class ModelRunner:
    def __init__(self, model_path: str, *, slots: int, context_length: int | None, device: str, dtype: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(_pick_device(device))
        self.dtype = _pick_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        config = self.model.config
        self.config = config
        self.vocab_size = int(config.vocab_size)
        max_pos = int(getattr(config, "max_position_embeddings", 2048))
        self.context_length = min(context_length or max_pos, max_pos)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(
            layers=config.num_hidden_layers,
            slots=slots,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            max_len=self.context_length,
            dtype=self.dtype,
            device=self.device,
        )
        # Decoders with per-layer attention types (Qwen2, …) take a mask per type; others
        # (Llama, …) take one prepared 4-D mask. Either way transformers builds none of its own,
        # which it could not do over the slot cache.
        self.layer_typed = getattr(config, "layer_types", None) is not None
        self.attention_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if self.attention_types != {"full_attention"}:
            # The slot cache keeps every position; sliding-window layers would need their own mask.
            raise ValueError(
                f"only full-attention models are supported, got layer types {self.attention_types}"
            )
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        # The linear modules LoRA adapters may target, by name (`lora.target_linears`).
        self.lora_linears = lora.target_linears(self.model)

    # --- forwards -------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self, first_slot: int, rows: list[ForwardRow]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Prefill `rows` into slots first_slot.. → (last-position logits [n, V], per-row full
        logits [L_i, V] where `full_logits` was asked, else None). Rows with the same tokens (a
        group's samples share their prompt) and the same adapter are computed once and their
        cache copied to the others' slots (`_prefill_unique`)."""
        if not any(r.full_logits for r in rows):
            first_of: dict[tuple, int] = {}
            source = [first_of.setdefault((id(r.adapter), *r.token_ids), i) for i, r in enumerate(rows)]
            if len(first_of) < len(rows):
                return self._prefill_unique(first_slot, rows, source, list(first_of.values())), [None] * len(
                    rows
                )
        return self._prefill(first_slot, rows)

    def _prefill_unique(
        self, first_slot: int, rows: list[ForwardRow], source: list[int], unique: list[int]
    ) -> torch.Tensor:
        """`prefill` of rows where `rows[i]` equals `rows[source[i]]`: the `unique` rows run into
        the first slots, then every slot gets its row's cache and logits (same values as a
        forward of its own: the same tokens at the same positions, no other row attended)."""
        logits, _ = self._prefill(first_slot, [rows[i] for i in unique])
        for i, s in enumerate(source):
            rows[i].copied = s != i
        at = {row: k for k, row in enumerate(unique)}
        index = torch.tensor([at[s] for s in source], device=self.device)
        t = max(len(rows[i].token_ids) for i in unique)
        for cache in (self.cache.key_cache, self.cache.value_cache):
            for layer in cache:
                block = layer[first_slot : first_slot + len(unique), :, :t]
                layer[first_slot : first_slot + len(rows), :, :t] = block.index_select(0, index)
        return logits.index_select(0, index)

    def _prefill(
        self, first_slot: int, rows: list[ForwardRow]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        lengths = [len(r.token_ids) for r in rows]
        t = max(lengths)
        self.cache.ensure(t)
        ids = torch.zeros((len(rows), t), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(r.token_ids, dtype=torch.long)
        ids = ids.to(self.device)
        length_t = torch.tensor(lengths, device=self.device)
        pos = torch.arange(t, device=self.device)
        mask = None  # rows of one length: SDPA's own causal mask
        if min(lengths) != t or not self.layer_typed:
            # mask[b, 0, i, j]: query i may attend key j (causal, and j is a real token of row b)
            mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < length_t[:, None, None])
            mask = mask[:, None]
        hidden = self._forward(
            [r.adapter for r in rows],
            input_ids=ids,
            attention_mask=self._masks(mask),
            position_ids=pos[None, :].expand(len(rows), t),
            cache=self.cache.view(first_slot, len(rows), None, t),
        )
        last = hidden[torch.arange(len(rows), device=self.device), length_t - 1]
        full = [
            self.lm_head(hidden[i, : lengths[i]]).float() if r.full_logits else None
            for i, r in enumerate(rows)
        ]
        return self.lm_head(last).float(), full

    @torch.no_grad()
    def decode(
        self,
        last_tokens: list[int],
        kv_starts: list[int],
        adapters: list[lora.LoraAdapter | None] | None = None,
    ) -> torch.Tensor:
        """Feed `last_tokens[i]` at position `kv_starts[i]` of slot i, for slots 0..n-1 → logits [n, V];
        slot i runs with `adapters[i]` (None, or no list: the base model)."""
        kv_len = max(kv_starts) + 1
        self.cache.ensure(kv_len)
        starts = torch.tensor(kv_starts, device=self.device)
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        mask = None  # rows of one length attend to every cached key
        if min(kv_starts) + 1 != kv_len or not self.layer_typed:
            mask = (torch.arange(kv_len, device=self.device)[None, :] <= starts[:, None])[:, None, None, :]
        hidden = self._forward(
            adapters,
            input_ids=ids,
            attention_mask=self._masks(mask),
            position_ids=starts[:, None],
            cache=self.cache.view(0, len(last_tokens), kv_starts, kv_len),
        )
        return self.lm_head(hidden[:, 0]).float()

    def _forward(self, adapters: list[lora.LoraAdapter | None] | None, **inputs) -> torch.Tensor:
        """The decoder's last hidden states; row i with `adapters[i]`'s update where it names one."""
        if adapters is None or not any(adapters):
            return self.decoder(**inputs, use_cache=True).last_hidden_state
        with lora.applied(self.lora_linears, adapters):
            return self.decoder(**inputs, use_cache=True).last_hidden_state

    def _masks(self, mask: torch.Tensor | None) -> dict[str, torch.Tensor | None] | torch.Tensor:
        """A prepared mask per attention type (layer-typed decoders), else the 4-D mask itself."""
        if not self.layer_typed:
            assert mask is not None
            return mask
        return dict.fromkeys(self.attention_types, mask)

    # --- weights --------------------------------------------------------------------------

    def check_weights(self, named: dict[str, torch.Tensor], *, full: bool) -> str | None:
        """Why `named` cannot be loaded, or None. `full`: every parameter must be covered
        (a checkpoint directory); otherwise any subset may be (one broadcast bucket)."""
        state = self.model.state_dict()
        unknown = sorted(set(named) - set(state))
        if unknown:
            return f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}"
        bad = [
            f"{k}: got {tuple(t.shape)}, expected {tuple(state[k].shape)}"
            for k, t in named.items()
            if t.shape != state[k].shape
        ]
        if bad:
            return f"shape mismatch: {bad[:3]}"
        if full:
            missing = self.missing_weights(named)
            if missing:
                return f"checkpoint misses parameters: {missing[:5]}{' …' if len(missing) > 5 else ''}"
        return None

    def missing_weights(self, names) -> list[str]:
        """The parameters (and buffers) that `names` does not cover, a tied alias covered by
        its twin."""
        state = self.model.state_dict()
        covered = {state[k].data_ptr() for k in names if k in state}
        return sorted(k for k, t in state.items() if t.data_ptr() not in covered)

    @torch.no_grad()
    def apply_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Copy `named` into the parameters. `copy_` converts dtype and device in the same
        pass; a `.to()` first would allocate and fill a converted copy of every tensor (a bf16
        checkpoint into fp32 parameters took 3x as long)."""
        state = self.model.state_dict()
        for name, tensor in named.items():
            state[name].copy_(tensor)


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files of an HF checkpoint directory."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    files = sorted(glob.glob(os.path.join(path, WEIGHTS_GLOB)))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        named.update(load_file(f))
    return named


def _pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pick_dtype(dtype: str, device: torch.device):
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
