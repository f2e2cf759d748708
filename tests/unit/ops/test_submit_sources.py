"""`[submit]` names its prompts one way: a file, or a reasoning-gym dataset that the launcher
turns into `asyncrl submit --reasoning-gym` arguments (services/ops/run_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.services.ops.run_config import SubmitSection


def test_a_reasoning_gym_source_becomes_submit_arguments():
    section = SubmitSection.model_validate(
        {"reasoning_gym": {"dataset": "gsm_symbolic", "size": 50, "seed": 3, "config": {"difficulty": 1.0}}}
    )
    args = section.source_args()
    assert args == ["--reasoning-gym", "gsm_symbolic", "--size", "50", "--seed", "3",
                    "--config", json.dumps({"difficulty": 1.0}), "--system-prompt", "default"]  # fmt: skip
    boxed = SubmitSection.model_validate(
        {"reasoning_gym": {"dataset": "lcm", "size": 1, "boxed_fallback": True}}
    )
    assert boxed.source_args()[-1] == "--boxed-fallback"
    assert SubmitSection(file="data/x.jsonl").source_args() == [str(Path("data/x.jsonl").resolve())]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "exactly one of `file` or `reasoning_gym`"),
        ({"file": "x.jsonl", "reasoning_gym": {"dataset": "lcm", "size": 1}}, "exactly one of"),
        (
            {"reasoning_gym": {"dataset": "lcm", "size": 1}, "reward_spec": {"verifier": "math"}},
            "drop reward_spec",
        ),
        ({"reasoning_gym": {"dataset": "lcm", "size": 0}}, "greater than or equal to 1"),
    ],
)
def test_a_submit_section_without_one_clear_source_is_refused(raw, message):
    with pytest.raises(ValidationError) as exc:
        SubmitSection.model_validate(raw)
    assert message in str(exc.value)
