"""Experiment tracking with Weights & Biases: rank 0's step metrics, run config and evaluations.

Off unless `[trainer.wandb] enabled = true`. `wandb` is the optional extra `asyncrl[tracking]`,
imported only when tracking is enabled; enabled without it, the trainer stops at start (every
rank, before the model loads) with `TrackingUnavailable` naming the install command.

What is logged, with W&B's step = the policy version v:
  train/<gauge>          the step's loss-side figures (loss, clip_fraction, reward_mean, …)
  perf/…                 tokens, tokens_per_second, step_seconds, <phase>_seconds
  data/…                 staleness mean/max, response length mean, truncation rate,
                         zero-spread groups, groups trained/dropped
  eval/<name>/…          accuracy, format_rate, formatted_accuracy, mean_reward, mean_length,
                         prompts and the evaluated `version` (a figure that is null is left out)
                         (each eval_id once, at the step of the last trained version; W&B plots
                         them against `eval/<name>/version`)
and as the run config: the resolved trainer settings (Redis password redacted) plus `meta`
(run id, model path, world size, backend, torch/transformers versions, git commit, host).

Offline mode (the default) writes `<dir>/wandb/offline-run-*/run-*.wandb` for a later
`wandb sync` and needs no network; wandb still starts its local `wandb-core` process (over a
Unix socket) with system-metric sampling, console capture, code/requirements capture and error
reporting off.

Failure policy: tracking never stops training. Every call into wandb (and into the evaluation
source) goes through `Tracker._contain`, the one place that catches: the failure is counted in
`asyncrl_trainer_tracking_errors_total{op}`, logged, and the step goes on; a failed
`wandb.init` leaves the tracker inert for the run (online mode: an unreachable server costs
wandb's `init_timeout`, 90 s, at start). Not guaranteed: a failed log is not retried
(that row or evaluation is missing in W&B); W&B runs are not resumed across trainer restarts:
each start is a new W&B run in the group of the run id, so a version redone after a crash
appears in both runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

from asyncrl.proto.states import JobState
from asyncrl.services.runtime.logging import log_event
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.config import TrainerSettings

log = logging.getLogger("asyncrl.trainer")

INSTALL_HINT = "pip install 'asyncrl[tracking]'"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Fields of an `asyncrl.proto.evals.EvalSummary` logged per evaluation.
EVAL_FIELDS = (
    "version",
    "accuracy",
    "format_rate",
    "formatted_accuracy",
    "mean_reward",
    "mean_length",
    "prompts",
)
GIT_TIMEOUT_S = 5.0  # a hung git (network filesystem, lock) must not hold up the trainer's start
# Quiet and light on a small machine: no console capture, no system-metric sampling process,
# no machine/git/code/requirements probing (the `meta` config says what matters). The `x_`
# settings are wandb-private; the ones an installed wandb does not know are left out.
WANDB_SETTINGS = {
    "console": "off",
    "silent": True,
    "disable_code": True,
    "disable_git": True,
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "x_save_requirements": False,
}


class TrackingUnavailable(RuntimeError):
    """W&B tracking is enabled but wandb is not installed."""


def require_wandb() -> None:
    """Fail fast (without importing wandb) when tracking is enabled and wandb is missing."""
    if importlib.util.find_spec("wandb") is None:
        raise TrackingUnavailable(
            f"[trainer.wandb] enabled = true needs wandb: {INSTALL_HINT} (or set enabled = false)"
        )


def build_tracker(cfg: TrainerSettings, rank: int, world: int, backend: str) -> Tracker | None:
    """The trainer's tracker: None when tracking is off or on ranks other than 0. Every rank
    checks that wandb is installed, so a missing install stops all of them alike."""
    if not cfg.wandb.enabled:
        return None
    require_wandb()
    return Tracker(cfg, run_metadata(cfg, world, backend)) if rank == 0 else None


class Tracker:
    """Rank 0's W&B run. A context manager: `__enter__` starts the run, `__exit__` finishes it,
    with exit code 1 when an exception is leaving the training loop."""

    def __init__(self, cfg: TrainerSettings, meta: dict[str, Any]) -> None:
        ws = cfg.wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        if ws.mode != "online":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # wandb-core's crash reports go online
        try:
            import wandb
        except ImportError as exc:
            raise TrackingUnavailable(f"wandb failed to import ({exc}): {INSTALL_HINT}") from exc
        self._wandb = wandb
        known = getattr(wandb.Settings, "model_fields", {})
        self.dir = Path(ws.dir or cfg.output_dir)
        self.init_kwargs: dict[str, Any] = {
            "project": ws.project,
            "entity": ws.entity,
            "name": ws.name or cfg.run,
            "group": ws.group or cfg.run,
            "tags": list(ws.tags),
            "mode": ws.mode,
            "dir": str(self.dir),
            "config": {**public_config(cfg), "meta": meta},
            "settings": wandb.Settings(**{k: v for k, v in WANDB_SETTINGS.items() if k in known}),
        }
        self.run = None
        self.step = 0  # the W&B step evaluations are logged at: the last trained version
        self.logged_evals: set[str] = set()
        self._eval_axes: set[str] = set()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)

    def start(self) -> None:
        with self._contain("init"):
            self.dir.mkdir(parents=True, exist_ok=True)
            self.run = self._wandb.init(**self.init_kwargs)
            log_event(
                log,
                "tracking started",
                mode=self.init_kwargs["mode"],
                dir=str(self.dir),
                project=self.init_kwargs["project"],
                name=self.init_kwargs["name"],
            )

    def log_step(self, version: int, metrics: dict[str, float]) -> None:
        """One row at W&B step `version`."""
        self.step = version
        if self.run is not None:
            with self._contain("log_step"):
                self.run.log(metrics, step=version)

    def log_evaluation(self, summary: dict) -> None:
        """Log one evaluation summary (an `EvalSummary` as a dict: `eval_id`, `name` and
        `EVAL_FIELDS`) under `eval/<name>/…`, at most once per eval_id; a null figure is left
        out; a summary whose log fails is counted and not retried."""
        with self._contain("log_evaluation"):
            eval_id = str(summary["eval_id"])
            if eval_id in self.logged_evals:
                return
            self.logged_evals.add(eval_id)
            prefix = f"eval/{summary['name']}"
            row = {f"{prefix}/{k}": summary[k] for k in EVAL_FIELDS if summary[k] is not None}
            if self.run is None:
                return
            if prefix not in self._eval_axes:  # chart an eval against the version it evaluated
                self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/version")
                self._eval_axes.add(prefix)
            self.run.log(row, step=self.step)

    def log_evaluations(self, fetch: Callable[[], list[dict]]) -> None:
        """Log the summaries from `fetch` whose state is "done" and that are not logged yet,
        oldest version first and at most one per name per call: two evaluations of one name in
        one W&B step would overwrite each other, so the rest wait for the next step."""
        if self.run is None:
            return
        todo: list[dict] = []
        with self._contain("fetch_evaluations"):
            done = [
                s
                for s in fetch()
                if s.get("state") == JobState.done and str(s.get("eval_id")) not in self.logged_evals
            ]
            names: set[str] = set()
            for s in sorted(done, key=lambda s: s["version"]):
                if s["name"] not in names:
                    names.add(s["name"])
                    todo.append(s)
        for s in todo:
            self.log_evaluation(s)

    def finish(self, exit_code: int = 0) -> None:
        """End the run and stop wandb's service process: trainer workers leave through
        `os._exit`, so wandb's own atexit teardown never runs."""
        run, self.run = self.run, None
        if run is not None:
            with self._contain("finish"):
                run.finish(exit_code=exit_code)
                self._wandb.teardown()

    @contextmanager
    def _contain(self, op: str) -> Iterator[None]:
        """The one place a tracking failure is caught: counted, logged, and training goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 — any W&B or evaluation-source failure: tracking must not stop training
            tm.TRACKING_ERRORS.labels(op).inc()
            log_event(
                log,
                "tracking failed",
                level=logging.WARNING,
                op=op,
                error=f"{type(exc).__name__}: {exc}",
                inert=op == "init",
            )


def public_config(cfg: TrainerSettings) -> dict[str, Any]:
    """The resolved settings as W&B's run config, without the Redis password."""
    out = cfg.model_dump(mode="json")
    out["redis_url"] = redact_url(cfg.redis_url)
    return out


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def run_metadata(cfg: TrainerSettings, world: int, backend: str) -> dict[str, Any]:
    return {
        "run_id": cfg.run,
        "model_path": cfg.model_path,
        "world_size": world,
        "backend": backend,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "git_commit": git_commit(PACKAGE_DIR),
        "host": socket.gethostname(),
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(root: Path) -> str | None:
    """HEAD of `root` if `root` itself is a git checkout (an installed package is not), else None."""
    if not (root / ".git").exists():
        return None
    try:
        res = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):  # no git binary, or it hung
        return None
    commit = res.stdout.strip()
    return commit if res.returncode == 0 and commit else None
