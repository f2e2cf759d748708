"""Attention for packed micro-batches without flash attention: causal SDPA per sample segment.

A packed row holds several samples back to back, their position ids restarting at 0 at each
(trainer/batch.py `collate_packed`). transformers turns that into a dense block-diagonal mask,
and SDPA then computes the whole row's `L × L` scores under it: a 4,096-token bin of eight
512-token samples does 8× the attention work of its samples and keeps the square for backward.
`segment_attention` (registered with transformers as `asyncrl_segments`) cuts the row at every
position id 0 and runs causal SDPA on each sample's own queries and keys: the work of unpacked
samples, no mask at all. It is the trainer's attention on CPU when packing is on (on CUDA,
`flash_attention_2` reads the same position ids as varlen sequence boundaries).

With a padding mask (a padded batch through the same model) it is transformers' SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

NAME = "asyncrl_segments"


def segment_bounds(position_ids: Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of the samples in one packed row: a sample starts where its position is 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, starts[1:] + [int(position_ids.numel())]))


def segment_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [B, Hq, L, D], key/value [B, Hkv, L, D] → ([B, L, Hq, D], None). A sliding window
    (Mistral, Qwen2's `use_sliding_window`, …) applies within each sample: query i sees keys
    i − window < j ≤ i of its own sample."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if position_ids is None:  # attending over the whole row would cross samples without a word
        raise ValueError(
            f"{type(module).__name__} does not pass position_ids to its attention: it cannot run "
            f"packed rows with {NAME}"
        )
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b in range(query.shape[0]):
        parts = []
        for s, e in segment_bounds(position_ids[b if position_ids.shape[0] > 1 else 0]):
            band = None
            if sliding_window is not None and e - s > sliding_window:
                i = torch.arange(e - s, device=query.device)
                band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
            parts.append(
                torch.nn.functional.scaled_dot_product_attention(
                    query[b : b + 1, :, s:e],
                    key[b : b + 1, :, s:e],
                    value[b : b + 1, :, s:e],
                    attn_mask=band,
                    dropout_p=dropout,
                    scale=scaling,
                    is_causal=band is None,
                    enable_gqa=gqa,
                )
            )
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """The mask builder that goes with `segment_attention`: segments come from the position ids."""
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    return None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def use_segment_attention(model: nn.Module) -> None:
    """Switch a transformers model (every attention layer) to `segment_attention`."""
    model.set_attn_implementation(register())
