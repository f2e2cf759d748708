"""benchmarks/real_vs_trl.py's pure helpers: TRL's batch layout and settings, reading our
trainer's step log, the rates, and the in-process `math` scoring."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "real_vs_trl.py"
spec = importlib.util.spec_from_file_location("real_vs_trl", PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules["real_vs_trl"] = bench  # dataclasses look their module up while the class is built
spec.loader.exec_module(bench)


def test_trl_layout_makes_one_optimizer_step_of_b_times_g_completions():
    assert bench.trl_layout(64, 8) == (8, 8)  # 8 per micro-batch x 8 accumulation steps = 64
    assert bench.trl_layout(24, 16) == (8, 3)  # 16 does not divide 24: gcd 8, 24 / 8 = 3
    assert bench.trl_layout(16, 32) == (16, 1)  # a micro-batch above the step: the whole step at once


def test_trl_args_carry_our_trainer_settings():
    b = bench.Bench(
        config="c.toml", model="m", prompts_per_step=8, group_size=8, max_new_tokens=200, temperature=0.7,
        lr=1e-5, micro_batch_size=8, grad_clip=1.0, clip_low=0.2, clip_high=0.28, advantage="grpo",
        loss_agg="token_mean", kl_coef=0.0, entropy_coef=0.0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_eps=1e-8, bf16=True, seed=0, minutes=10, eval_size=200, math_max_chars=8192,
        threads=2,
    )  # fmt: skip
    a = bench.trl_args(b, "out")
    assert a["per_device_train_batch_size"] * a["gradient_accumulation_steps"] == 64
    assert (a["num_generations"], a["max_completion_length"], a["temperature"]) == (8, 200, 0.7)
    assert (a["learning_rate"], a["lr_scheduler_type"], a["max_grad_norm"]) == (1e-5, "constant", 1.0)
    assert (a["epsilon"], a["epsilon_high"], a["beta"]) == (0.2, 0.28, 0.0)
    assert (a["loss_type"], a["scale_rewards"]) == ("dapo", "group")  # token mean, group-std advantages
    assert a["use_vllm"] is False and a["gradient_checkpointing"] is False and a["shuffle_dataset"] is False


def _step(version: int, ts: float, groups: int, tokens: int, wait: float, fb: float, reward: float) -> str:
    return json.dumps({"ts": ts, "msg": "step", "version": version, "groups": groups, "tokens": tokens,
                       "step_s": wait + fb, "wait_s": wait, "forward_backward_s": fb, "reward_mean": reward})  # fmt: skip


def test_trainer_window_counts_the_steps_finished_by_the_limit():
    lines = [
        "W1125 torchrun says something that is not JSON",
        json.dumps({"ts": 90.0, "msg": "trainer resumed", "version": 0}),
        _step(1, 100.0, 8, 500, wait=3.0, fb=2.0, reward=0.25),
        _step(2, 110.0, 7, 400, wait=1.0, fb=2.5, reward=0.5),
        _step(3, 121.0, 8, 450, wait=1.0, fb=2.0, reward=0.75),  # after the limit: not counted
    ]
    w = bench.trainer_window(lines, t_end=120.0)
    assert (w["steps"], w["version"], w["groups"], w["tokens"]) == (2, 2, [8, 7], 900)  # 500 + 400
    assert w["step_ends"] == [100.0, 110.0] and w["rewards"] == [0.25, 0.5]
    # wait 3 + 1 = 4, forward_backward 2 + 2.5 = 4.5, step (5 + 3.5) = 8.5
    assert w["phases_s"] == {"wait": 4.0, "forward_backward": 4.5, "step": 8.5}


def test_rates_over_the_window_and_between_first_and_last_step():
    r = bench.rates([64, 56], tokens=900, wall_s=30.0, step_ends=[100.0, 110.0])
    assert r["samples"] == 120
    assert r["samples_per_s"] == pytest.approx(4.0)  # 120 / 30
    assert r["tokens_per_s"] == pytest.approx(30.0)  # 900 / 30
    assert r["steady_samples_per_s"] == pytest.approx(5.6)  # the second step's 56 samples in 10 s
    assert bench.rates([64], 100, 30.0, [100.0])["steady_samples_per_s"] is None  # one step: no interval
    assert bench.ratio(2.0, 4.0) == 0.5 and bench.ratio(1.0, 0.0) is None and bench.ratio(None, 1.0) is None


def test_score_reads_the_last_box_else_the_tail():
    assert bench.score("8 + 4 = 12, so \\boxed{12}.", "12", 8192) == 1.0
    assert bench.score("first \\boxed{12}, no: \\boxed{13}", "12", 8192) == 0.0  # the last box counts
    assert bench.score("The answer is 12", "12", 8192) == 1.0  # no box: the tail is parsed
    assert bench.score("\\boxed{11}", "12", 8192) == 0.0
