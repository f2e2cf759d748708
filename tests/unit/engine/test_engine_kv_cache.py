"""The engine's slot KV cache: batched prefill and decode of rows of different lengths give the
logits of a plain full-sequence forward, including after slots move and the cache grows."""

from __future__ import annotations

import pytest
import torch

from asyncrl.services.engine.model_runner import ForwardRow, ModelRunner
from asyncrl.services.ops.tinymodel import build_tiny_model

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


def test_rows_with_one_prompt_are_prefilled_once_and_decode_apart(runner):
    """Samples of a group share their prompt: the prefill computes it once (a forward over the
    distinct rows only) and copies its cache to every slot, at a first slot > 0 too; each row
    then decodes its own tokens and its logits are those of its own full sequence."""
    calls = []
    plain = runner._prefill

    def counting(first_slot, rows):
        calls.append(len(rows))
        return plain(first_slot, rows)

    runner._prefill = counting
    try:
        runner.cache.key_cache[0].fill_(7.0)  # stale values in the slots: all must be overwritten
        seqs = [[1, 5, 6], [1, 8, 9, 10, 11], [1, 5, 6]]
        rows = [ForwardRow(list(s)) for s in seqs]
        last, full = runner.prefill(1, rows)
    finally:
        runner._prefill = plain
    assert calls == [2] and full == [None] * 3
    assert [r.copied for r in rows] == [False, False, True]  # the third row's prompt was not computed
    for i, s in enumerate(seqs):
        assert torch.allclose(last[i], full_forward(runner, s)[-1], atol=1e-5)
    runner.cache.move(3, 0, len(seqs[2]))  # slots 1..3 hold the rows; decode runs on slots 0..n-1
    seqs = [seqs[2], seqs[0], seqs[1]]
    for step in range(3):
        for i, s in enumerate(seqs):
            s.append(3 + (5 * step + 11 * i) % 40)  # rows 0 and 1 (one prompt) now differ
        logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for i, s in enumerate(seqs):
            assert torch.allclose(logits[i], full_forward(runner, s)[-1], atol=1e-5)
    _, full = runner.prefill(0, [ForwardRow([1, 4, 4], full_logits=True), ForwardRow([1, 4, 4])])
    assert full[0] is not None and full[1] is None  # prompt logprobs asked: no sharing, full logits kept
