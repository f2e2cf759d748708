"""W&B tracking (trainer/tracking.py) against a real wandb in offline mode.

Each test writes a real offline run under tmp_path and reads it back with wandb's own reader,
`wandb leet inspect --json` (every record of `offline-run-*/run-*.wandb`: the run with its
config, history rows, metric definitions, the exit record) and `--summary --json` (the run's
resolved state: config, last summary, exit code). Offline wandb writes no
`files/wandb-summary.json` or `files/config.yaml`; the transaction log holds everything.
The trainer test at the end runs `asyncrl train` for two steps with tracking on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from factories import edit_sample, make_group
from prometheus_client import REGISTRY
from pydantic import ValidationError

from asyncrl.proto.evals import EvalSummary
from asyncrl.proto.states import JobState
from asyncrl.services.runtime.config import load_settings
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.batch import build_rows
from asyncrl.trainer.config import TrainerSettings
from asyncrl.trainer.data import Taken
from asyncrl.trainer.loop import record
from asyncrl.trainer.tracking import (
    INSTALL_HINT,
    Tracker,
    TrackingUnavailable,
    build_tracker,
    git_commit,
    redact_url,
)

pytest.importorskip("wandb", reason="the asyncrl[tracking] extra is not installed")
ROOT = Path(__file__).resolve().parents[3]


def settings(out: Path, **wandb) -> TrainerSettings:
    return TrainerSettings(model_path="/models/tiny", run="run-7", output_dir=str(out),
                           redis_url="redis://:hunter2@10.0.0.5:6379/0", wandb={"enabled": True, **wandb})  # fmt: skip


def inspect(out: Path) -> tuple[list[dict], dict]:
    """(every record, the summary view) of the one offline run under `out`."""
    (log_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)]
    records = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    summary = subprocess.run(
        [*cmd, "--summary"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [json.loads(line) for line in records.splitlines() if line.strip()], json.loads(summary)


def history(records: list[dict]) -> dict[int, dict]:
    """W&B step → the row logged at it (wandb-internal `_step`, `_runtime`, `_timestamp` left out)."""
    rows = {}
    for r in records:
        if r["type"] == "history":
            rows[r["history"]["step"].get("num", 0)] = {
                k: v for k, v in r["history"]["item"].items() if not k.startswith("_")
            }
    return rows


def errors(op: str) -> float:
    return REGISTRY.get_sample_value("asyncrl_trainer_tracking_errors_total", {"op": op}) or 0.0


# An evaluation as the trainer fetches it (`EvalStore.list()`, dumped): 16 prompts, 12 formatted,
# 10 right. The fields the tracker reads must be the summary's own.
EVAL = EvalSummary(eval_id="e-1", name="gsm8k", source="auto", state=JobState.done, version=1, prompts=16,
                   accuracy=10 / 16, formatted=12, format_rate=12 / 16, formatted_accuracy=10 / 12,
                   mean_reward=0.5, mean_length=41.5, created_at=0.0).model_dump()  # fmt: skip
LOGGED = {"accuracy": 10 / 16, "format_rate": 12 / 16, "formatted_accuracy": 10 / 12, "mean_reward": 0.5,
          "mean_length": 41.5, "prompts": 16}  # what is logged of EVAL besides its version  # fmt: skip


def logged(name: str, version: int, **changes) -> dict:
    return {
        f"eval/{name}/{k}": v for k, v in {"version": version, **LOGGED, **changes}.items() if v is not None
    }


def test_offline_run_holds_steps_config_and_evaluation(tmp_path):
    tracker = build_tracker(settings(tmp_path, tags=["smoke"]), rank=0, world=2, backend="gloo")
    with tracker:
        tracker.log_step(1, {"train/reward_mean": 0.25, "train/loss": -0.125, "perf/tokens": 96.0})
        tracker.log_step(2, {"train/reward_mean": 0.75, "train/loss": 0.5, "perf/tokens": 80.0})
        tracker.log_evaluation(EVAL)
        tracker.log_evaluation({**EVAL, "accuracy": 0.0})  # the same eval_id again: ignored
    records, summary = inspect(tmp_path)

    rows = history(records)
    assert rows == {
        1: {"train/reward_mean": 0.25, "train/loss": -0.125, "perf/tokens": 96},
        2: {"train/reward_mean": 0.75, "train/loss": 0.5, "perf/tokens": 80, **logged("gsm8k", 1)},
    }  # fmt: skip
    (axis,) = [r["metric"] for r in records if r["type"] == "metric"]
    assert (axis["glob_name"], axis["step_metric"]) == ("eval/gsm8k/*", "eval/gsm8k/version")

    assert (summary["state"], summary["exit_code"], summary["step"]) == ("finished", 0, 2)
    assert {k: v for k, v in summary["summary"].items() if not k.startswith("_")} == rows[2]
    assert (summary["name"], summary["project"], summary["tags"]) == ("run-7", "asyncrl", ["smoke"])
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["run_group"] == "run-7"
    config = summary["config"]
    assert config["meta"]["run_id"] == "run-7" and config["run"] == "run-7"
    assert {k: config["meta"][k] for k in ("model_path", "world_size", "backend")} == {
        "model_path": "/models/tiny", "world_size": 2, "backend": "gloo"}  # fmt: skip
    assert config["meta"]["git_commit"] == git_commit(ROOT)  # this checkout's HEAD, or None outside git
    assert config["meta"]["torch"] and config["meta"]["host"]
    assert config["batch_groups"] == 8 and config["loss"]["kind"] == "ppo"
    assert config["redis_url"] == "redis://:***@10.0.0.5:6379/0"  # the password stays on this machine


def test_record_logs_every_step_figure_and_finished_evaluations(tmp_path):
    """trainer/loop.py `record` end to end into W&B, with the step's arithmetic by hand."""
    g0 = edit_sample(make_group("g0", n=4, n_tokens=5), 1, truncated=True)  # rewards 0, 1/4, 1/2, 3/4
    g1 = make_group("g1", n=2, n_tokens=3, seed=1)  # rewards 0, 1/2
    taken = Taken(groups=[g0, g1], staleness=[0, 2], dropped=["s1"], discarded=["z1"])
    rows = build_rows(taken.groups, "grpo")
    stats = {"loss": 0.5, "clip_frac": 0.125, "is_weight_mean": 1.0, "is_weight_max": 2.0, "is_masked_frac": 0.0,
             "mismatch_kl": 0.01, "approx_kl": 0.02, "entropy": 1.5, "ref_kl": 0.0, "grad_norm": 3.0, "tokens": 30.0,
             "lr": 2.5e-7}  # fmt: skip
    evals = [EVAL, {**EVAL, "eval_id": "e-2", "version": 2, "accuracy": 0.75},  # same name: waits a step
             {**EVAL, "eval_id": "e-3", "name": "math", "accuracy": 0.25, "formatted": None, "format_rate": None,
              "formatted_accuracy": None},  # a verifier without a format: those figures are left out
             {**EVAL, "eval_id": "e-4", "name": "math", "state": "running"}]  # fmt: skip
    tracker = build_tracker(settings(tmp_path), rank=0, world=1, backend="gloo")
    p = SimpleNamespace(ranks=SimpleNamespace(is_main=True), status=tm.TrainerStatus(), tracker=tracker,
                        fetch_evaluations=lambda: evals)  # fmt: skip
    with tracker:
        record(p, 5, taken, rows, dict(stats), {"wait": 0.5, "recompute": 0.25}, 2.0)
        record(p, 6, taken, rows, dict(stats), {"wait": 0.5, "recompute": 0.25}, 2.0)
    rows_by_step = history(inspect(tmp_path)[0])

    step = rows_by_step[5]
    expected = {
        "train/reward_mean": 2.0 / 6,  # (0 + .25 + .5 + .75 + 0 + .5) / 6 samples
        "train/loss": 0.5, "train/clip_fraction": 0.125, "train/is_weight_mean": 1, "train/is_weight_max": 2,
        "train/is_masked_fraction": 0, "train/mismatch_kl": 0.01, "train/approx_kl": 0.02, "train/entropy": 1.5,
        "train/ref_kl": 0, "train/grad_norm": 3, "train/lr": 2.5e-7,
        "perf/tokens": 30, "perf/tokens_per_second": 20,  # 30 tokens / (2.0 s - 0.5 s waiting)
        "perf/step_seconds": 2, "perf/wait_seconds": 0.5, "perf/recompute_seconds": 0.25,
        "data/staleness_mean": 1, "data/staleness_max": 2,
        "data/response_length_mean": 26 / 6,  # 4 samples of 5 tokens, 2 of 3
        "data/truncation_rate": 1 / 6, "data/zero_spread_groups": 1,  # g0, g1 have spread; z1 was discarded
        "data/groups_trained": 2, "data/groups_dropped": 1,
        **logged("gsm8k", 1), **logged("math", 1, accuracy=0.25, format_rate=None, formatted_accuracy=None),
    }  # fmt: skip
    assert step.keys() == expected.keys()
    assert step == pytest.approx(expected, rel=1e-12)
    later = {k: v for k, v in rows_by_step[6].items() if k.startswith("eval/")}
    assert later == logged("gsm8k", 2, accuracy=0.75)  # e-1, e-3 once; e-4 not done
    assert tracker.logged_evals == {"e-1", "e-2", "e-3"}


def test_failures_are_counted_and_never_raised(tmp_path):
    tracker = build_tracker(settings(tmp_path), rank=0, world=1, backend="gloo")
    before = {op: errors(op) for op in ("init", "log_step", "fetch_evaluations", "log_evaluation")}
    with tracker:
        tracker.log_step(1, {"train/loss": 1.0})

        def broken(*args, **kwargs):
            raise RuntimeError("wandb-core went away")

        real_log, tracker.run.log = tracker.run.log, broken
        tracker.log_step(2, {"train/loss": 2.0})  # no exception: counted and logged
        tracker.log_evaluation(EVAL)  # likewise, and not retried
        tracker.run.log = real_log
        tracker.log_evaluation(EVAL)
        tracker.log_evaluations(lambda: 1 / 0)  # the evaluation source failing
        tracker.log_step(3, {"train/loss": 3.0})
    assert history(inspect(tmp_path)[0]) == {1: {"train/loss": 1}, 3: {"train/loss": 3}}
    assert errors("log_step") - before["log_step"] == 1
    assert errors("log_evaluation") - before["log_evaluation"] == 1
    assert errors("fetch_evaluations") - before["fetch_evaluations"] == 1

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    inert = build_tracker(settings(tmp_path, dir=str(blocked)), rank=0, world=1, backend="gloo")
    with inert:  # wandb.init cannot create its directory: the tracker stays inert
        inert.log_step(1, {"train/loss": 1.0})
    assert inert.run is None and errors("init") - before["init"] == 1


def test_an_exception_leaving_the_loop_finishes_the_run_as_failed(tmp_path):
    tracker = build_tracker(settings(tmp_path), rank=0, world=1, backend="gloo")
    with pytest.raises(RuntimeError, match="boom"), tracker:
        tracker.log_step(1, {"train/loss": 1.0})
        raise RuntimeError("boom")
    _, summary = inspect(tmp_path)
    assert (summary["state"], summary["exit_code"]) == ("failed", 1)


def test_disabled_tracking_never_imports_wandb():
    script = textwrap.dedent("""
        import sys
        import asyncrl.trainer.parts, asyncrl.trainer.loop, asyncrl.trainer.main
        from asyncrl.trainer.config import TrainerSettings
        from asyncrl.trainer.tracking import build_tracker
        enabled = sys.argv[1] == "on"
        cfg = TrainerSettings(model_path="/m", output_dir=sys.argv[2], wandb={"enabled": enabled})
        tracker = build_tracker(cfg, 0, 1, "gloo")
        print(tracker is not None, "wandb" in sys.modules)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {mode: subprocess.run([sys.executable, "-c", script, mode, "/nonexistent/out"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120, check=True).stdout.split()
           for mode in ("off", "on")}  # fmt: skip
    assert out == {"off": ["False", "False"], "on": ["True", "True"]}  # "on" shows the check can fail


def test_enabled_without_wandb_is_a_clear_error_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an install without the extra looks like
    for rank in (0, 1):
        with pytest.raises(TrackingUnavailable, match="asyncrl\\[tracking\\]") as err:
            build_tracker(settings(tmp_path), rank=rank, world=2, backend="gloo")
        assert INSTALL_HINT in str(err.value)
    with pytest.raises(TrackingUnavailable, match="asyncrl\\[tracking\\]"):
        Tracker(settings(tmp_path), meta={})
    assert build_tracker(settings(tmp_path, enabled=False), rank=0, world=2, backend="gloo") is None


def test_toml_and_env_set_the_wandb_table(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[trainer]\nmodel_path = "/m"\n[trainer.wandb]\nproject = "rl"\ntags = ["a", "b"]\nmode = "online"\n'
    )
    monkeypatch.setenv("ASYNCRL_TRAINER_WANDB__ENABLED", "true")
    monkeypatch.setenv("ASYNCRL_TRAINER_WANDB__ENTITY", "team")
    s = load_settings(TrainerSettings, ["--config", str(cfg)], prog="t", section="trainer")
    assert s.wandb.model_dump() == {"enabled": True, "project": "rl", "entity": "team", "name": None, "group": None,
                                    "tags": ["a", "b"], "mode": "online", "dir": None}  # fmt: skip
    monkeypatch.delenv("ASYNCRL_TRAINER_WANDB__ENABLED")
    monkeypatch.delenv("ASYNCRL_TRAINER_WANDB__ENTITY")
    assert TrainerSettings(model_path="/m").wandb.model_dump() == {
        "enabled": False, "project": "asyncrl", "entity": None, "name": None, "group": None, "tags": [],
        "mode": "offline", "dir": None}  # fmt: skip


@pytest.mark.parametrize("bad,match", [
    ({"mode": "cloud"}, "mode"),
    ({"project": ""}, "project"),
    ({"tags": [""]}, "tags"),
    ({"tags": ["x" * 65]}, "tags"),
    ({"api_key": "k"}, "api_key"),
])  # fmt: skip
def test_bad_wandb_settings_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        TrainerSettings(model_path="/m", wandb=bad)


def test_git_commit_and_redaction(tmp_path):
    assert git_commit(tmp_path) is None  # not a checkout: no commit, no failure
    (tmp_path / ".git").mkdir()
    assert git_commit(tmp_path) is None  # a broken one likewise
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# ---- the real trainer, two steps, tracking on


def reward_group(gid: str, rewards: list[float], lengths: list[int]):
    from asyncrl.proto import Group, Sample

    samples = [Sample(prompt_id=f"p-{gid}", index=i, completion_ids=np.arange(3, 3 + n, dtype=np.int32),
                      behavior_logprobs=np.full(n, -3.5, np.float32), versions=np.zeros(n, np.int32),
                      finish_reason="stop", reward=r, reward_status="scored")
               for i, (r, n) in enumerate(zip(rewards, lengths))]  # fmt: skip
    return Group.build(group_id=gid, job_id="job-1", prompt_tokens=np.array([1, 5, 6, 7], np.int32),
                       reward_spec={"verifier": "reverse"}, samples=samples, submit_version=0)  # fmt: skip


@pytest.mark.slow
def test_trainer_logs_each_version_to_wandb(tmp_path, redis_url, run_id):
    from asyncrl.buffer import Buffer, Groups
    from asyncrl.services.ops.tinymodel import build_tiny_model

    build_tiny_model(tmp_path / "tiny", seed=3)
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[trainer]
redis_url = "{redis_url}"
run = "{run_id}"
model_path = "{tmp_path / "tiny"}"
output_dir = "{out}"
batch_groups = 2
max_staleness = 4
max_steps = 2
lr = 3e-7
lr_warmup_steps = 4
micro_batch_size = 4
publish = "none"
block_ms = 200
heartbeat_s = 0.3
device = "cpu"

[trainer.wandb]
enabled = true
tags = ["integration"]
""")
    groups = {"g0": [1.0, 0.0, 1.0, 0.5], "g1": [0.0, 0.0, 1.0, 1.0], "g2": [1.0, 1.0, 0.0, 0.5],
              "g3": [0.25, 0.0, 0.0, 1.0]}  # fmt: skip
    lengths = [3, 4, 5, 6]
    producer = Groups(Buffer(redis_url, run_id))
    for gid, rewards in groups.items():
        assert producer.put([reward_group(gid, rewards, lengths)]) == [True]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "asyncrl.services.ops.cli", "train", "--config", str(config), "--nproc-per-node", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]

    audit = [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]
    trained = {e["version"]: e["groups"] for e in audit if e["event"] == "step"}
    logged = {e["version"]: e for e in (json.loads(ln) for ln in res.stderr.splitlines() if ln.startswith("{"))
              if e.get("msg") == "step"}  # fmt: skip
    records, summary = inspect(out)
    rows = history(records)
    assert sorted(rows) == sorted(trained) == [1, 2]
    for v, gids in trained.items():
        # no shaping, every sample scored: in put order, v=1 trains g0, g1 (4.5 / 8 = 0.5625) and
        # v=2 g2, g3 (3.75 / 8 = 0.46875); the audit log says which groups each version took
        expected = sum(r for g in gids for r in groups[g]) / (4 * len(gids))
        assert rows[v]["train/reward_mean"] == pytest.approx(expected, rel=1e-12)
        assert logged[v]["reward_mean"] == pytest.approx(
            rows[v]["train/reward_mean"], abs=1e-6
        )  # the log line, rounded
        # warmup over 4 versions: update v uses 3e-7 · v / 4 (trainer/schedule.py)
        assert rows[v]["train/lr"] == pytest.approx(3e-7 * v / 4, rel=1e-12)
        assert logged[v]["lr"] == pytest.approx(3e-7 * v / 4, rel=1e-5)
        assert rows[v]["data/groups_trained"] == 2 and rows[v]["data/response_length_mean"] == 4.5
    assert summary["exit_code"] == 0 and summary["state"] == "finished"
    assert summary["config"]["meta"]["run_id"] == run_id and summary["config"]["meta"]["world_size"] == 1
    assert summary["config"]["meta"]["backend"] == "gloo" and summary["tags"] == ["integration"]
