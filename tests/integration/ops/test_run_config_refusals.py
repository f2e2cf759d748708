"""A bad run config is refused by the real `asyncrl` commands before anything starts: every
problem named by table and field, a non-zero exit, no traceback, no process spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[3]
TABLES = ["run", "model", "launch", "submit", "demo", "engine", "rollout", "reward", "trainer"]


def asyncrl(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.services.ops.cli", *argv],
        cwd=cwd,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def bad_config(tmp_path: Path, change) -> Path:
    raw = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    raw["run"]["dir"] = str(tmp_path / "run")
    raw["model"]["path"] = str(tmp_path / "run" / "base")
    raw["submit"] = {"file": str(tmp_path / "prompts.jsonl")}
    change(raw)
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def assert_refused_before_starting(out: subprocess.CompletedProcess, tmp_path: Path, *named: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for line in named:
        assert line in out.stderr, (line, out.stderr)
    assert out.stdout == ""  # not one `[launcher]` line: nothing was started
    assert not (tmp_path / "run").exists()  # no logs, no model, no embedded Redis


def test_asyncrl_up_names_a_typo_in_every_table_before_it_starts_anything(tmp_path):
    def typo_everywhere(raw: dict) -> None:
        for table in TABLES:
            raw[table]["typo_key"] = 1
        raw["trainer"]["loss"] = {"kindd": "ppo"}

    out = asyncrl("up", "--config", str(bad_config(tmp_path, typo_everywhere)), cwd=tmp_path)
    named = [f"[{table}] typo_key: Extra inputs are not permitted" for table in TABLES]
    assert_refused_before_starting(
        out, tmp_path, *named, "[trainer.loss] kindd: Extra inputs are not permitted"
    )
    assert out.stderr.startswith("asyncrl up: ")


def test_asyncrl_up_and_demo_refuse_a_wrong_type(tmp_path):
    def wrong_type(raw: dict) -> None:
        raw["trainer"]["lr"] = "fast"

    config = str(bad_config(tmp_path, wrong_type))
    named = "[trainer] lr: Input should be a valid number"
    assert_refused_before_starting(asyncrl("up", "--config", config, cwd=tmp_path), tmp_path, named)
    run_dir = tmp_path / "run"  # the demo's --run-dir, which it would create first
    demo = asyncrl("demo", "--config", config, "--run-dir", str(run_dir), cwd=tmp_path)
    assert_refused_before_starting(demo, tmp_path, named)


def test_a_service_refuses_a_problem_in_another_service_s_table(tmp_path):
    """The reward service reads only [reward], but the whole file is checked before it starts:
    a typo in [trainer] surfaces in every container that shares the file."""

    def typo(raw: dict) -> None:
        raw["trainer"]["lrr"] = 1e-5

    out = asyncrl("reward", "--config", str(bad_config(tmp_path, typo)), "--port", "1", cwd=tmp_path)
    assert_refused_before_starting(out, tmp_path, "asyncrl reward: ", "[trainer] lrr: Extra inputs")
