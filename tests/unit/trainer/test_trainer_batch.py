"""trainer/batch.py: groups → rows (advantages, masking of unscored samples, overlong shaping)
→ rank shards → padded tensors, on a hand-built group.

Group: prompt [1, 5, 6]; s0 completion [7, 8] reward 1; s1 [9] reward 0; s2 [10, 11, 12]
timed out (no reward). GRPO over the scored two: mean 0.5, centred ±0.5, unbiased std
√(0.5/1) = 0.7071068 → advantages ±0.5/(0.7071068 + 1e-6) = ±0.7071058; s2 is masked and counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import edit_sample

from asyncrl.proto import Group, Sample
from asyncrl.trainer.batch import Shaping, build_rows, collate, collate_packed, shard_rows, zero_spread_groups

torch.set_num_threads(1)


def sample(i, completion, reward, status="scored", truncated=False):
    n = len(completion)
    return Sample(prompt_id="p", index=i, completion_ids=np.array(completion, np.int32),
                  behavior_logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32),
                  finish_reason="length", truncated=truncated, reward=reward, reward_status=status)  # fmt: skip


@pytest.fixture
def group():
    return Group.build(group_id="g", job_id="j", prompt_tokens=np.array([1, 5, 6], np.int32),
                       reward_spec={"verifier": "reverse"}, submit_version=0,
                       samples=[sample(0, [7, 8], 1.0), sample(1, [9], 0.0, truncated=True),
                                sample(2, [10, 11, 12], None, "timeout")])  # fmt: skip


def test_rows_mask_unscored_and_count(group):
    out = build_rows([group], "grpo")
    assert [r.valid for r in out.rows] == [True, True, False]
    assert out.rows[0].advantage == pytest.approx(0.7071058, abs=1e-6)
    assert out.rows[1].advantage == pytest.approx(-0.7071058, abs=1e-6)
    assert out.rows[2].advantage == 0.0
    assert dict(out.masked) == {"timeout": 1}
    assert out.lengths == [2, 1, 3] and out.truncated == 1
    assert out.rewards == [1.0, 0.0]


def test_overlong_shaping_changes_rewards(group):
    # max_len 3, window 2 → penalty from length 1: s0 (2) −0.5 → 0.5; s1 (1) 0 → 0.
    # dr_grpo: mean 0.25 → [0.25, −0.25] (without shaping: [0.5, −0.5])
    plain = build_rows([group], "dr_grpo")
    shaped = build_rows([group], "dr_grpo", Shaping(max_len=3, cache_len=2))
    assert [r.advantage for r in plain.rows[:2]] == [0.5, -0.5]
    assert [r.advantage for r in shaped.rows[:2]] == [0.25, -0.25]
    assert shaped.rewards == [0.5, 0.0]


def test_zero_spread_detection_uses_scored_samples_only(group):
    flat = edit_sample(group, 1, reward=1.0)  # scored rewards now [1, 1]; the timed-out one does not count
    assert zero_spread_groups([group, flat]) == [False, True]


def test_shards_and_padded_tensors(group):
    rows = build_rows([group], "grpo").rows
    assert shard_rows(rows, 0, 2) == [rows[0], rows[2]]
    assert shard_rows(rows, 1, 2) == [rows[1], None]  # padded so both ranks run the same forwards
    assert shard_rows(rows, 1, 2, multiple=4) == [rows[1], None, None, None]
    b = collate([rows[0], rows[2], None], pad_id=0)
    # L = max(3+2, 3+3, 1) = 6, T = 3
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 8, 0], [1, 5, 6, 10, 11, 12], [0, 0, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]
    # the hidden state at position len(prompt) − 1 + t (of row i: flat i·L + …) predicts completion token t
    assert b.token_index.tolist() == [[2, 3, 0], [8, 9, 10], [0, 0, 0]]
    assert b.present.tolist() == [[True, True, False], [True, True, True], [False, False, False]]
    assert b.position_ids is None and not b.packed
    assert b.targets.tolist() == [[7, 8, 0], [10, 11, 12], [0, 0, 0]]
    assert b.mask.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]  # the timed-out sample is masked
    assert b.behavior_logprobs.tolist() == [[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]
    assert b.advantages[0, :2].tolist() == pytest.approx([0.7071058] * 2, abs=1e-6)
    assert b.real_rows == 2


def test_packed_tensors(group):
    rows = build_rows([group], "grpo").rows
    b = collate_packed([rows[0], None, rows[2]], pad_id=0)
    # one row, the two samples back to back (the filler row left out), positions restarting at 0
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 8, 1, 5, 6, 10, 11, 12]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
    assert b.attention_mask is None and b.packed
    assert b.token_index.tolist() == [[2, 3, 0], [7, 8, 9]]
    assert b.present.tolist() == [[True, True, False], [True, True, True]]
    assert b.targets.tolist() == [[7, 8, 0], [10, 11, 12]]
    assert b.mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert b.real_rows == 2
    empty = collate_packed([None, None], pad_id=0)
    assert empty.input_ids.tolist() == [[0]] and empty.real_rows == 0 and not empty.present.any()


def test_pack_first_fit_decreasing_within_budget():
    from asyncrl.trainer.batch import pack

    lengths = [3, 40, 5, 38, 4, 36, 6, 30, 2, 41, 7, 33, 3, 29, 5, 35]
    rows = _rows_of_lengths(lengths)
    total = [len(r.prompt_tokens) + len(r.completion_ids) for r in rows]
    bins = pack(rows, 64)
    assert sorted(id(r) for b in bins for r in b) == sorted(id(r) for r in rows)  # every row exactly once
    sizes = [sum(len(r.prompt_tokens) + len(r.completion_ids) for r in b) for b in bins]
    assert max(sizes) <= 64
    assert -(-sum(total) // 64) <= len(bins) <= -(-sum(total) // 64) + 1, (
        sizes
    )  # at most one bin over the bound
    alone = pack(rows, 20)  # rows longer than the budget get a bin each, never split
    assert all(len(b) == 1 for b in alone if len(b[0].prompt_tokens) + len(b[0].completion_ids) > 20)
    assert sum(len(b) for b in alone) == len(rows)


def _rows_of_lengths(lengths, seed=0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(len(lengths) // 4):
        prompt = np.array([1, *rng.integers(3, 40, 2 + g)], np.int32)
        samples = [
            sample(i, rng.integers(3, 40, n).tolist(), float(i % 2))
            for i, n in enumerate(lengths[4 * g : 4 * g + 4])
        ]
        groups.append(Group.build(group_id=f"g{g}", job_id="j", prompt_tokens=prompt, reward_spec={"verifier": "reverse"},
                                  samples=samples, submit_version=0))  # fmt: skip
    return build_rows(groups, "grpo").rows


def test_micro_batches_group_rows_of_similar_length_within_each_minibatch():
    from asyncrl.trainer.batch import micro_batches

    lengths = [3, 40, 5, 38, 4, 36, 6, 30, 2, 41, 7, 33, 3, 29, 5, 35]
    rows = _rows_of_lengths(lengths)
    micro = micro_batches(rows, 0, 1, 2, 2, 0, torch.device("cpu"))
    assert len(micro) == 8  # 2 minibatches x 4 micro-batches of 2 rows
    for m, half in enumerate((rows[:8], rows[8:])):
        got = [tuple(t[: int(n)].tolist()) for b in micro[4 * m : 4 * m + 4]
               for t, n in zip(b.targets, (b.targets != 0).sum(-1))]  # fmt: skip
        want = sorted((tuple(r.completion_ids.tolist()) for r in half), key=len, reverse=True)
        assert got == want  # every row of minibatch m once, in m's micro-batches, longest first
    padded = sum(b.input_ids.numel() for b in micro)
    naive = sum(collate(rows[i : i + 2], 0).input_ids.numel() for i in range(0, 16, 2))
    assert padded < 0.7 * naive, (padded, naive)


def test_sorted_micro_batches_give_the_unsorted_update(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.services.ops.tinymodel import build_tiny_model
    from asyncrl.trainer.batch import micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.step import StepConfig, policy_step

    build_tiny_model(tmp_path, seed=3)
    rows = _rows_of_lengths([2, 9, 3, 8, 1, 7, 4, 6], seed=1)
    cfg = StepConfig(loss=LossConfig(), grad_clip=1e9)
    after = []
    for micro in (micro_batches(rows, 0, 1, 1, 3, 0, torch.device("cpu")),
                  [collate(rows[i : i + 3], 0) for i in range(0, 8, 3)]):  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        policy_step(model, opt, micro, [None] * len(micro), [None] * len(micro), cfg, torch.device("cpu"))
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    base = torch.cat(
        [p.detach().flatten() for p in AutoModelForCausalLM.from_pretrained(tmp_path).parameters()]
    )
    assert (after[0] - base).abs().max() > 1e-4  # the step moved the weights
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-6)
