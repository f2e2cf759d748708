"""The run config is validated whole (services/ops/run_config.py): every table with its own
settings class, an unknown table or key refused, each problem named by table and field."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w

from asyncrl.services.ops.run_config import (
    COMMAND_LINE_PLACEHOLDER,
    RunConfigError,
    load_run_config,
    validate_run_config,
)

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"


def demo_raw() -> dict:
    return tomllib.loads(DEMO.read_text())


def problems(data: dict, **kwargs) -> list[str]:
    with pytest.raises(RunConfigError) as refused:
        validate_run_config(data, "x.toml", **kwargs)
    return refused.value.problems


@pytest.mark.parametrize(
    "table", ["run", "model", "launch", "demo", "engine", "rollout", "reward", "trainer", "trainer.loss"]
)
def test_an_unknown_key_in_any_table_is_refused_by_name(table):
    raw = demo_raw()
    node = raw
    for part in table.split("."):
        node = node.setdefault(part, {})
    node["typo_key"] = 1
    assert problems(raw) == [f"[{table}] typo_key: Extra inputs are not permitted"]


def test_a_wrong_type_and_a_broken_bound_are_refused_by_name():
    raw = demo_raw()
    raw["trainer"]["lr"] = "fast"
    raw["rollout"]["max_active_groups"] = 0
    raw["trainer"]["wandb"] = {"mode": "sometimes"}
    assert problems(raw) == [
        "[rollout] max_active_groups: Input should be greater than 0",
        "[trainer] lr: Input should be a valid number, unable to parse string as a number",
        "[trainer.wandb] mode: Input should be 'online', 'offline' or 'disabled'",
    ]


def test_a_table_s_own_checks_and_unknown_tables_are_reported():
    raw = demo_raw()
    raw["trainer"]["publish"] = "distributed"  # the trainer's own check: it needs engine_urls
    raw["trainr"] = {"lr": 1.0}
    raw["launch"]["engine_gpus"] = [0, "x"]
    assert problems(raw) == [
        "[launch] engine_gpus.1: Input should be a valid integer, unable to parse string as an integer",
        "[trainer]: publish=distributed needs engine_urls",
        "[trainr]: unknown table",
    ]


def test_disk_deltas_for_sglang_engines_are_refused_with_the_reason():
    raw = demo_raw()
    raw["launch"]["engine_kind"] = "sglang"
    raw["trainer"]["publish_delta"] = True
    (problem,) = problems(raw)
    assert problem.startswith('[trainer] publish_delta with publish = "disk" cannot feed SGLang engines: ')
    assert "loads every *.safetensors of a directory with no base version" in problem
    assert 'use publish = "distributed"' in problem
    raw["trainer"].update(publish="distributed", engine_urls=["http://127.0.0.1:30000"])
    assert validate_run_config(raw).trainer.publish_delta  # over the broadcast they may


def test_the_launching_commands_need_a_model_table():
    raw = demo_raw()
    del raw["model"]
    assert validate_run_config(raw).model is None  # a service reads its own table only
    assert problems(raw, require=("model",)) == ["[model]: this table is required here"]
    assert problems({"model": {}}) == ["[model] path: Field required"]


def test_the_fields_launches_pass_on_the_command_line_may_be_left_out():
    config = validate_run_config(demo_raw())
    assert config.engine.model == config.rollout.tokenizer == config.trainer.model_path == "runs/demo/base"
    bare = validate_run_config({"trainer": {"lr": 1e-5}})
    assert bare.trainer.model_path == COMMAND_LINE_PLACEHOLDER and bare.trainer.lr == 1e-5


def test_an_unreadable_file_is_a_refusal_not_a_traceback(tmp_path):
    with pytest.raises(RunConfigError, match=r"missing.toml: cannot read it"):
        load_run_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[trainer\n")
    with pytest.raises(RunConfigError, match=r"bad.toml: not TOML"):
        load_run_config(tmp_path / "bad.toml")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_the_written_config_reads_back_as_it_was(path, tmp_path):
    """`asyncrl demo` writes the run config it launches with tomli-w, after changing paths,
    seeds and evaluation settings: what the services read back is what it validated."""
    raw = tomllib.loads(path.read_text())
    raw.setdefault("trainer", {})["seed"] = 7
    raw.setdefault("rollout", {}).update(eval_file=str(tmp_path / "heldout.jsonl"), eval_every=10)
    written = tmp_path / "config.toml"
    written.write_text(tomli_w.dumps(raw))
    assert tomllib.loads(written.read_text()) == raw
    assert load_run_config(written) == validate_run_config(raw)


@pytest.mark.parametrize(
    ("command", "table", "values", "flags", "refused"),
    [
        # a non-loopback engine needs a token, here given as a flag
        ("engine", "engine", {"host": "0.0.0.0"}, ["--api-token", "t0k3n-long-enough-4-check"], "API token"),
        # automatic evaluations need their file
        ("rollout", "rollout", {"eval_every": 5}, ["--eval-file", "/data/eval.jsonl"], "eval_file"),
    ],
)
def test_a_service_s_flags_complete_its_own_table(
    tmp_path, monkeypatch, command, table, values, flags, refused
):
    """The check of `asyncrl <service> --config F …` sees the service's table as the service will:
    the flags replace the file's values. Without the flag, the same file is refused, named."""
    monkeypatch.delenv("ASYNCRL_API_TOKEN", raising=False)
    monkeypatch.delenv("ASYNCRL_ENGINE_API_TOKEN", raising=False)
    raw = demo_raw()
    raw[table] = {**raw.get(table, {}), **values}
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(raw))
    config = load_run_config(path, command=command, argv=["--config", str(path), *flags])
    assert getattr(config, table).model_dump()[flags[0][2:].replace("-", "_")] not in (None, [])
    with pytest.raises(RunConfigError) as without:
        load_run_config(path, command=command, argv=["--config", str(path)])
    assert any(f"[{table}]" in p and refused in p for p in without.value.problems), without.value.problems
    # another service's flags never fill this table
    other = "reward" if command != "reward" else "engine"
    with pytest.raises(RunConfigError):
        load_run_config(path, command=other, argv=["--config", str(path), *flags])
