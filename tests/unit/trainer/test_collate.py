"""The collates fill a micro-batch's per-token tensors for all samples at once; these tests hold
them to a sample-by-sample reference (written here, one slice at a time) on random micro-batches:
prompts shared or not, completions of 0 to 7 tokens, unscored samples, episode loss masks, rank
padding rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.trainer.batch import Row, collate, collate_packed, collate_shared


def random_rows(rng: np.random.Generator, n_prompts: int) -> list[Row | None]:
    rows: list[Row | None] = []
    for _ in range(n_prompts):
        prompt = rng.integers(3, 40, int(rng.integers(1, 6))).astype(np.int32)
        for _ in range(int(rng.integers(1, 5))):
            c = int(rng.integers(0, 8))
            mask = (rng.random(c) < 0.7).astype(np.float32) if rng.random() < 0.3 else None
            rows.append(Row(prompt, rng.integers(3, 40, c).astype(np.int32), rng.normal(-2, 1, c).astype(np.float32),
                            float(rng.normal()), bool(rng.random() < 0.8), mask))  # fmt: skip
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]  # a prompt's samples need not be next to each other
    return rows + [None] * int(rng.integers(0, 3))


def reference_tokens(rows: list[Row | None], first, rest=None, keep_padding=False) -> dict[str, np.ndarray]:
    """Per sample, one slice at a time: completion token t is predicted by first(k) + t, or by
    rest(k) + t − 1 for t > 0 when `rest` is given. Rank padding rows (None) are left out, or
    kept as empty samples in their places (`keep_padding`: the padded layout)."""
    real = [r for r in rows if r is not None]
    t_max = max(1, max((len(r.completion_ids) for r in real), default=1))
    if keep_padding:
        real = rows
    n = max(len(real), 1)
    out = {k: np.zeros((n, t_max), dtype=d) for k, d in (("token_index", np.int64), ("present", bool),
           ("targets", np.int64), ("mask", np.float32), ("behavior_logprobs", np.float32), ("advantages", np.float32))}  # fmt: skip
    for k, row in enumerate(real):
        if row is None:
            continue
        c = len(row.completion_ids)
        for t in range(c):
            out["token_index"][k, t] = first(k) + t if rest is None or t == 0 else rest(k) + t - 1
            out["present"][k, t] = True
            out["targets"][k, t] = row.completion_ids[t]
            out["behavior_logprobs"][k, t] = row.behavior_logprobs[t]
            if row.valid:
                out["mask"][k, t] = 1.0 if row.loss_mask is None else row.loss_mask[t]
                out["advantages"][k, t] = row.advantage
    return out


def assert_tokens(batch, want: dict[str, np.ndarray]) -> None:
    for name, array in want.items():
        got = getattr(batch, name).numpy()
        assert got.dtype == array.dtype and np.array_equal(got, array), name


@pytest.mark.parametrize("seed", range(20))
def test_padded_rows(seed):
    rows = random_rows(np.random.default_rng(seed), 4)
    batch = collate(rows, 0)
    width = batch.input_ids.shape[1]
    real = [i for i, r in enumerate(rows) if r is not None]
    assert_tokens(
        batch, reference_tokens(rows, lambda k: k * width + len(rows[k].prompt_tokens) - 1, keep_padding=True)
    )
    for i, row in enumerate(rows):
        seq = [0] if row is None else [*row.prompt_tokens, *row.completion_ids]
        assert batch.input_ids[i, : len(seq)].tolist() == [int(x) for x in seq]
        assert batch.attention_mask[i].tolist() == [1] * len(seq) + [0] * (width - len(seq))
    assert batch.real_rows == len(real)


@pytest.mark.parametrize("seed", range(20))
def test_packed_rows(seed):
    rows = random_rows(np.random.default_rng(100 + seed), 4)
    real = [r for r in rows if r is not None]
    batch = collate_packed(rows, 0)
    starts = np.cumsum([0] + [len(r.prompt_tokens) + len(r.completion_ids) for r in real])
    assert_tokens(batch, reference_tokens(rows, lambda k: int(starts[k]) + len(real[k].prompt_tokens) - 1))
    assert batch.input_ids[0].tolist() == [
        int(x) for r in real for x in (*r.prompt_tokens, *r.completion_ids)
    ]


@pytest.mark.parametrize("seed", range(20))
def test_shared_prompt_rows(seed):
    rows = random_rows(np.random.default_rng(200 + seed), 4)
    real = [r for r in rows if r is not None]
    batch = collate_shared(rows, 0)
    width = batch.input_ids.shape[1]
    # The reference layout, tree by tree: the prompt, then each completion minus its last token.
    trees: dict[bytes, list[int]] = {}
    for k, r in enumerate(real):
        trees.setdefault(np.asarray(r.prompt_tokens, np.int64).tobytes(), []).append(k)
    first, rest = {}, {}
    ids = np.zeros((len(trees) + len(rows) - len(real), width), np.int64)
    pos = np.zeros_like(ids)
    mask = np.zeros((ids.shape[0], width, width), bool)
    for row_no, members in enumerate(trees.values()):
        prompt = real[members[0]].prompt_tokens
        p = len(prompt)
        ids[row_no, :p], pos[row_no, :p] = prompt, np.arange(p)
        for i in range(p):
            mask[row_no, i, : i + 1] = True
        start = p
        for k in members:
            c = len(real[k].completion_ids)
            first[k], rest[k] = row_no * width + p - 1, row_no * width + start
            for j in range(max(c - 1, 0)):
                ids[row_no, start + j], pos[row_no, start + j] = real[k].completion_ids[j], p + j
                mask[row_no, start + j, :p] = True
                mask[row_no, start + j, start : start + j + 1] = True
            start += max(c - 1, 0)
    for r in range(ids.shape[0]):
        for i in range(width):
            mask[r, i, i] = True
    assert_tokens(batch, reference_tokens(rows, first.__getitem__, rest.__getitem__))
    assert np.array_equal(batch.input_ids.numpy(), ids)
    assert np.array_equal(batch.position_ids.numpy(), pos)
    assert batch.attention_mask.shape == (ids.shape[0], 1, width, width)
    assert np.array_equal(batch.attention_mask[:, 0].numpy(), mask)


def test_an_empty_micro_batch_is_one_padding_row():
    for collate_fn in (collate, collate_shared):
        batch = collate_fn([None, None], 0)
        assert (
            batch.real_rows == 0
            and not batch.present.any()
            and torch.equal(batch.mask, torch.zeros_like(batch.mask))
        )
