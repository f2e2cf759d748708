"""The engine's slot KV cache: batched prefill and decode of rows of different lengths give the
logits of a plain full-sequence forward, including after slots move and the cache grows."""

from __future__ import annotations

import pytest
import torch

from services.common.tinymodel import build_tiny_model
from services.engine.model_runner import ForwardRow, ModelRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_model")
    build_tiny_model(path, seed=3)
    return ModelRunner(str(path), slots=4, context_length=300, device="cpu", dtype="float32")


def full_forward(runner, tokens):
    with torch.no_grad():
        return runner.model(torch.tensor([tokens])).logits[0].float()


def test_prefill_and_decode_match_full_forward(runner):
    seqs = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1] + [4] * 140]  # the last one grows the cache past 128
    last, full = runner.prefill(0, [ForwardRow(s, full_logits=True) for s in seqs])
    for i, s in enumerate(seqs):
        ref = full_forward(runner, s)
        assert torch.allclose(last[i], ref[-1], atol=1e-5)
        assert torch.allclose(full[i], ref, atol=1e-5)
    for step in range(4):
        for i, s in enumerate(seqs):
            s.append(3 + (7 * step + 5 * i) % 40)
        logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for i, s in enumerate(seqs):
            assert torch.allclose(logits[i], full_forward(runner, s)[-1], atol=1e-5)
    # slot 2 moves into slot 0 (as when request 0 finishes); decoding continues correctly
    runner.cache.move(2, 0, len(seqs[2]))  # every token of seqs[2] has its KV after the decodes
    seqs = [seqs[2], seqs[1]]
    for s in seqs:
        s.append(17)
    logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
    for i, s in enumerate(seqs):
        assert torch.allclose(logits[i], full_forward(runner, s)[-1], atol=1e-5)


def test_cache_refuses_to_grow_past_the_context(runner):
    with pytest.raises(ValueError, match="context length"):
        runner.cache.ensure(301)


def test_rows_of_equal_length_take_the_unmasked_path(runner):
    seqs = [[1, 5, 6, 7], [1, 8, 9, 10]]  # equal lengths: no mask, slice writes
    last, _ = runner.prefill(0, [ForwardRow(s) for s in seqs])
    for i, s in enumerate(seqs):
        assert torch.allclose(last[i], full_forward(runner, s)[-1], atol=1e-5)
    for step in range(3):
        for i, s in enumerate(seqs):
            s.append(20 + step + i)
        logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for i, s in enumerate(seqs):
            assert torch.allclose(logits[i], full_forward(runner, s)[-1], atol=1e-5)
