"""trainer/advantages.py against hand-computed examples.

Batch: group 0 rewards [0, 1, 2] (mean 1, centred [−1, 0, 1], unbiased var (1+0+1)/2 = 1),
       group 1 rewards [3, 3, 6] (mean 4, centred [−1, −1, 2], unbiased var (1+1+4)/2 = 3).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.trainer.advantages import group_advantages, overlong_penalty, zero_spread

torch.set_num_threads(1)
R = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 6.0]])
S3 = math.sqrt(3)


def close(a, b, tol=1e-5):
    return torch.allclose(a, torch.tensor(b, dtype=a.dtype), atol=tol)


def test_grpo():
    # group 0: [−1, 0, 1]/(1 + 1e-6); group 1: [−1, −1, 2]/(√3 + 1e-6) = [−0.5773503, −0.5773503, 1.1547005]
    adv = group_advantages(R, "grpo")
    assert close(adv, [[-1.0, 0.0, 1.0], [-0.5773503, -0.5773503, 1.1547005]])
    assert adv[0, 2].item() == pytest.approx(1 / (1 + 1e-6), rel=1e-7)


def test_dr_grpo():
    assert close(group_advantages(R, "dr_grpo"), [[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]])


def test_rloo():
    # r_i − mean of the others: 0 − 1.5 = −1.5, 1 − 1 = 0, 2 − 0.5 = 1.5; 3 − 4.5, 3 − 4.5, 6 − 3
    assert close(group_advantages(R, "rloo"), [[-1.5, 0.0, 1.5], [-1.5, -1.5, 3.0]])


def test_reinforce_pp():
    # centred [−1, 0, 1, −1, −1, 2]: batch mean 0, unbiased std √((1+0+1+1+1+4)/5) = √1.6 = 1.2649111
    # → ±1/1.2649111 = ±0.7905694, 2/1.2649111 = 1.5811388
    assert close(
        group_advantages(R, "reinforce_pp"),
        [[-0.7905694, 0.0, 0.7905694], [-0.7905694, -0.7905694, 1.5811388]],
    )


def test_zero_spread_group_gets_zero_advantage():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), "grpo")
    assert torch.equal(adv, torch.zeros(1, 4))


def test_invalid_samples_are_excluded_from_statistics():
    rewards = torch.tensor([[0.0, float("nan"), 2.0], [5.0, float("nan"), float("nan")]])
    # group 0 valid [0, 2]: mean 1, centred [−1, ·, 1], unbiased var 2 → grpo ±1/√2 = ±0.7071068
    # group 1 has one valid sample: no baseline → 0
    assert close(group_advantages(rewards, "grpo"), [[-0.7071068, 0.0, 0.7071068], [0.0, 0.0, 0.0]])
    # rloo with k = 2: 0 − 2 = −2, 2 − 0 = 2
    assert close(group_advantages(rewards, "rloo"), [[-2.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    # explicit mask on finite values: group 0 uses [0, 1] → centred [−0.5, 0.5]; group 1 [3, 3, 6] as before
    assert close(group_advantages(R, "dr_grpo", valid), [[-0.5, 0.5, 0.0], [-1.0, -1.0, 2.0]])


def test_bad_shape_and_kind():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        group_advantages(torch.zeros(3), "grpo")
    with pytest.raises(ValueError, match="unknown advantage kind"):
        group_advantages(R, "ppo")


def test_zero_spread_detection():
    rewards = torch.tensor(
        [[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [2.0, float("nan"), 2.0], [1.0, float("nan"), float("nan")]]
    )
    assert zero_spread(rewards).tolist() == [True, False, True, True]


def test_overlong_penalty():
    # max 10, cache 4 → penalty starts after 6: 5 → 0, 6 → 0, 8 → −2/4 = −0.5, 10 → −1, 12 → −1
    pen = overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_len=10, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)
