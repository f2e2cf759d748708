"""The math demo's held-out sets (services/ops/tasks.py, `asyncrl demo`): the SmolLM2 config's two
named sets are written and handed to the rollout service as automatic evaluations, the hard set
asks its problems after the worked example, and no training prompt is a problem of either."""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path

import pytest

from asyncrl.services.ops.demo_jobs import heldout_sets, math_task
from asyncrl.services.ops.run_config import DemoSection, RunConfigError, validate_run_config
from asyncrl.services.ops.tasks import SYSTEM_PROMPT, WORKED_EXAMPLE, HeldoutSet, math_problem

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "smollm2-math.toml"


def test_the_smollm2_config_evaluates_two_named_sets(tmp_path):
    raw = tomllib.loads(CONFIG.read_text())
    demo = DemoSection.model_validate(raw["demo"])
    sets = heldout_sets(demo, tmp_path, raw)
    assert list(sets) == ["heldout", "heldout-hard"]
    assert raw["rollout"]["eval_sets"] == {name: str(tmp_path / f"{name}.jsonl") for name in sets}
    assert (raw["rollout"]["eval_every"], raw["rollout"]["eval_max_new_tokens"]) == (5, 200)
    rollout = validate_run_config(raw).rollout
    assert list(rollout.auto_eval_files) == ["heldout", "heldout-hard"]
    for name, prompts in sets.items():
        written = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert written == prompts and len(prompts) == 100
        assert [p["prompt_id"] for p in prompts] == [f"{name}-{i}" for i in range(100)]
        assert len({p["messages"][-1]["content"] for p in prompts}) == 100  # distinct problems
    easy, hard = sets["heldout"][0]["messages"], sets["heldout-hard"][0]["messages"]
    assert easy[:3] == hard[:3] and [m["role"] for m in easy] == ["system", "user", "assistant", "user"]
    assert hard[:3] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": WORKED_EXAMPLE[0]},
        {"role": "assistant", "content": WORKED_EXAMPLE[1]},
    ]
    # the hard set is HeldoutSet's problems of the hard level, each with its answer as the gold
    problems = HeldoutSet(seed=1234, size=100, level="hard", worked_example=True).problems()
    assert [(p["messages"][-1]["content"], p["reward_spec"]) for p in sets["heldout-hard"]] == [
        (q, {"verifier": "math", "answer": str(a)}) for q, a in problems
    ]


def test_no_training_prompt_is_a_problem_of_any_heldout_set():
    """The easy training stream does draw problems of the hard set (two-digit sums up to 30 are
    in both levels); `train_prompts` drops every one of them, and the main set's."""
    demo = DemoSection.model_validate(tomllib.loads(CONFIG.read_text())["demo"])
    task = math_task(demo)
    held = {q for q, _ in task.heldout()} | {q for q, _ in task.more_heldout["heldout-hard"].problems()}
    hard = {q for q, _ in task.more_heldout["heldout-hard"].problems()}
    rng = random.Random(0)
    drawn = [math_problem(rng, demo.word_fraction, demo.level)[0] for _ in range(20_000)]
    assert any(q in hard for q in drawn)  # without the filter, training would see hard held-out problems
    trained = [p["messages"][-1]["content"] for p in task.train_prompts(20_000, random.Random(0))]
    assert len(trained) == 20_000 and not held.intersection(trained)


def test_eval_set_names_are_checked():
    with pytest.raises(ValueError, match="not be the main set's"):
        DemoSection.model_validate({"task": "math", "eval_sets": {"heldout": {}}})
    with pytest.raises(ValueError, match="must match"):
        DemoSection.model_validate({"task": "math", "eval_sets": {"has space": {}}})
    with pytest.raises(ValueError, match="worked_exampel"):
        DemoSection.model_validate({"task": "math", "eval_sets": {"hard": {"worked_exampel": True}}})
    raw = tomllib.loads(CONFIG.read_text())
    raw["demo"]["eval_sets"]["heldout-hard"]["level"] = "medium"
    with pytest.raises(RunConfigError, match="level"):
        validate_run_config(raw)


def test_worked_example_asks_training_and_the_main_set_after_the_worked_exchange():
    """`[demo] worked_example`: training prompts and the main held-out set get the worked exchange
    (the strict verifier's format shown once); a named set keeps its own setting."""
    plain = DemoSection(task="math", eval_size=5, eval_sets={"hard": {"size": 3}})
    shown = plain.model_copy(update={"worked_example": True})
    example = [
        {"role": "user", "content": WORKED_EXAMPLE[0]},
        {"role": "assistant", "content": WORKED_EXAMPLE[1]},
    ]
    for cfg, want in ((plain, []), (shown, example)):
        task = math_task(cfg)
        train = task.train_prompts(4, random.Random(0))
        for p in [*train, *task.heldout_prompts()]:
            assert p["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
            assert p["messages"][1:-1] == want
            assert p["messages"][-1]["role"] == "user" and p["messages"][-1]["content"] != WORKED_EXAMPLE[0]
        assert [m["role"] for m in task.more_heldout["hard"].prompts("hard")[0]["messages"]] == [
            "system",
            "user",
        ]
    # the same problems either way: only how they are asked changes
    assert [p["messages"][-1] for p in math_task(plain).heldout_prompts()] == [
        p["messages"][-1] for p in math_task(shown).heldout_prompts()
    ]
