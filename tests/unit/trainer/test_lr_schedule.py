"""trainer/schedule.py: the warmup + constant / cosine curve by hand, the LambdaLR that follows
it one step per version, its state round trip, and the settings that refuse a bad horizon."""

from __future__ import annotations

import io
import math

import pytest
import torch
from pydantic import ValidationError

from asyncrl.trainer.config import TrainerSettings
from asyncrl.trainer.schedule import build_scheduler, lr_factor

SQRT_HALF = math.sqrt(0.5)


def test_linear_warmup_then_constant():
    # W = 4: update n gets n / 4 until the 4th, then the full lr for good
    got = [lr_factor(n, "constant", warmup_steps=4) for n in range(1, 8)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert [lr_factor(n, "constant") for n in (1, 2, 1000)] == [1.0] * 3  # no warmup: the lr from update 1


def test_warmup_then_cosine_reaches_the_floor_at_decay_steps():
    # W = 2, D = 6, m = 0.1: after warmup, progress (n − 2) / 4 = 1/4, 1/2, 3/4, 1 and
    # f = 0.1 + 0.45 (1 + cos(π · progress)); past D it stays at m
    expected = [0.5, 1.0, 0.1 + 0.45 * (1 + SQRT_HALF), 0.55, 0.1 + 0.45 * (1 - SQRT_HALF), 0.1, 0.1, 0.1]
    got = [lr_factor(n, "cosine", warmup_steps=2, decay_steps=6, min_ratio=0.1) for n in range(1, 9)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # without warmup the first update already decays: (1 + cos(π/4)) / 2 with D = 4, m = 0
    assert lr_factor(1, "cosine", decay_steps=4) == pytest.approx((1 + SQRT_HALF) / 2, rel=1e-12)
    assert lr_factor(4, "cosine", decay_steps=4) == pytest.approx(0.0, abs=1e-15)


def optimizer(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr, weight_decay=0.1)


def lrs_of_updates(opt, sched, n: int) -> list[float]:
    """The lr each of the next n versions' updates uses, stepping the scheduler once per version
    after the optimizer, as trainer/loop.py does."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: moves nothing
        sched.step()
    return out


def test_the_scheduler_gives_update_n_lr_times_f_of_n():
    opt = optimizer(0.5)
    sched = build_scheduler(opt, "cosine", warmup_steps=2, decay_steps=6, min_ratio=0.1)
    assert opt.param_groups[0]["weight_decay"] == 0.1  # untouched by the schedule
    got = lrs_of_updates(opt, sched, 7)
    expected = [0.25, 0.5, 0.05 + 0.225 * (1 + SQRT_HALF), 0.275, 0.05 + 0.225 * (1 - SQRT_HALF), 0.05, 0.05]
    assert got == pytest.approx(expected, rel=1e-12)
    assert sched.last_epoch == 7


def test_a_restored_scheduler_continues_the_curve():
    """What the checkpoint stores (trainer/checkpoint.py extra.pt): the scheduler's state_dict and the
    optimizer's param groups, read back with weights_only=True into freshly built ones."""
    opt = optimizer()
    sched = build_scheduler(opt, "cosine", warmup_steps=2, decay_steps=6, min_ratio=0.1)
    lrs_of_updates(opt, sched, 3)
    buf = io.BytesIO()
    torch.save({"scheduler": sched.state_dict(), "param_groups": opt.state_dict()["param_groups"]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    uninterrupted = lrs_of_updates(opt, sched, 4)

    fresh_opt = optimizer()
    fresh = build_scheduler(fresh_opt, "cosine", warmup_steps=2, decay_steps=6, min_ratio=0.1)
    fresh_opt.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
    fresh.load_state_dict(saved["scheduler"])
    resumed = lrs_of_updates(fresh_opt, fresh, 4)
    assert resumed == uninterrupted == pytest.approx([0.275, 0.05 + 0.225 * (1 - SQRT_HALF), 0.05, 0.05])


@pytest.mark.parametrize("warmup,decay", [(0, None), (3, 3), (5, 2)])
def test_cosine_without_a_horizon_past_warmup_is_refused(warmup, decay):
    with pytest.raises(ValueError, match="decay_steps > warmup_steps"):
        build_scheduler(optimizer(), "cosine", warmup_steps=warmup, decay_steps=decay)


@pytest.mark.parametrize("bad,match", [
    ({"lr_schedule": "cosine"}, "lr_decay_steps"),  # max_steps 0: no horizon
    ({"lr_schedule": "cosine", "max_steps": 10, "lr_warmup_steps": 10}, "lr_warmup_steps"),
    ({"lr_schedule": "cosine", "lr_decay_steps": 4, "lr_warmup_steps": 4, "max_steps": 100}, "lr_warmup_steps"),
    ({"lr_decay_steps": 100}, "cosine only"),
    ({"lr_min_ratio": 0.1}, "cosine only"),
    ({"lr_schedule": "cosine", "max_steps": 10, "lr_min_ratio": 1.5}, "less than or equal to 1"),
    ({"lr_warmup_steps": -1}, "greater than or equal to 0"),
    ({"lr_schedule": "linear"}, "lr_schedule"),
])  # fmt: skip
def test_bad_schedule_settings_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        TrainerSettings(model_path="/m", **bad)


def test_good_schedule_settings():
    s = TrainerSettings(
        model_path="/m", lr_schedule="cosine", max_steps=90, lr_warmup_steps=9, lr_min_ratio=0.1
    )
    assert (s.lr_schedule, s.lr_decay_steps, s.lr_warmup_steps, s.lr_min_ratio) == ("cosine", None, 9, 0.1)
    s = TrainerSettings(model_path="/m", lr_schedule="cosine", lr_decay_steps=50)  # runs until stopped
    assert (s.max_steps, s.lr_decay_steps) == (0, 50)
    s = TrainerSettings(model_path="/m", lr_warmup_steps=20)
    assert (s.lr_schedule, s.lr_warmup_steps) == ("constant", 20)
