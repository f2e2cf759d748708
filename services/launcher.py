"""`asyncrl up --config configs/X.toml`: launch a local topology and supervise it.

Reads `[run]`, `[model]` and `[launch]` from the TOML file; every service also gets
`--config FILE` and reads its own table (`[engine]`, `[rollout]`, `[reward]`, `[trainer]`).
Starts, in order: Redis (embedded when no URL is given), reward replicas, engines (unless
external `engine_urls` are given), rollout replicas, the trainer (torchrun); health-checks each
before the next; streams every log line with a `[name]` prefix (and into `run_dir/logs/`);
stops in the reverse order on Ctrl-C, on SIGTERM, or when the trainer exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

STOP_GRACE_S = 15.0


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field("default", min_length=1, max_length=64, description="run id: buffer namespace")
    dir: str = Field("runs/default", description="logs, model, weights, checkpoints and embedded Redis")
    redis_url: str | None = Field(None, description="external Redis; unset starts an embedded one")


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="local HF model directory used by engines, rollout and trainer")
    build_tiny: bool = Field(False, description="build a tiny Qwen2 model + char tokenizer there if absent")
    tiny_chars: str | None = Field(None, description="vocabulary of the tiny model's char tokenizer")
    tiny_hidden_size: int = Field(128, gt=0)
    tiny_layers: int = Field(2, gt=0)
    tiny_tie_embeddings: bool = Field(True, description="share input embedding and LM head (Qwen2 default: no)")
    seed: int = Field(0)


class LaunchSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine_kind: Literal["reference", "sglang"] = Field("reference", description="what `engines` starts")
    engine_args: list[str] = Field(default_factory=list, description="extra flags for each started engine")
    engines: int = Field(1, ge=0, le=64, description="engines to start")
    engine_urls: list[str] = Field(default_factory=list, description="external engines (SGLang) instead")
    engine_port: int = Field(30000, gt=0, lt=65536, description="port of engine 0; engine i uses +i")
    reward_replicas: int = Field(1, ge=1, le=64)
    reward_port: int = Field(8002, gt=0, lt=65536)
    rollout_replicas: int = Field(1, ge=1, le=64)
    rollout_port: int = Field(8001, gt=0, lt=65536)
    trainer: bool = Field(True, description="start the trainer")
    trainer_nproc_per_node: int = Field(1, ge=1, le=64)
    trainer_metrics_port: int = Field(8003, gt=0, lt=65536)
    health_timeout_s: float = Field(180.0, gt=0)


class SubmitSection(BaseModel):
    """A dataset posted to rollout-0 once everything is healthy (`asyncrl submit`'s options)."""

    model_config = ConfigDict(extra="forbid")
    file: str = Field(description="JSONL of prompts: text | messages | input_ids, optional reward_spec")
    group_size: int | None = Field(None, ge=1)
    sampling_params: dict | None = None
    reward_spec: dict | None = None
    idempotency_key: str | None = None


class UpConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the services' own tables are theirs
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    launch: LaunchSection = Field(default_factory=LaunchSection)
    submit: SubmitSection | None = None

    @classmethod
    def load(cls, path: Path) -> UpConfig:
        return cls.model_validate(tomllib.loads(path.read_text()))


@dataclass
class Proc:
    name: str
    cmd: list[str]
    health_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Launcher:
    def __init__(self, cfg: UpConfig, config_path: Path, *, echo: bool = True):
        self.cfg, self.config_path, self.echo = cfg, config_path.resolve(), echo
        self.run_dir = Path(cfg.run.dir).resolve()
        self.procs: list[Proc] = []
        self.redis = None
        self.redis_url = cfg.run.redis_url
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ topology
    @property
    def engine_urls(self) -> list[str]:
        ln = self.cfg.launch
        return ln.engine_urls or [f"http://127.0.0.1:{ln.engine_port + i}" for i in range(ln.engines)]

    @property
    def reward_urls(self) -> list[str]:
        ln = self.cfg.launch
        return [f"http://127.0.0.1:{ln.reward_port + i}" for i in range(ln.reward_replicas)]

    def rollout_urls(self) -> list[str]:
        ln = self.cfg.launch
        return [f"http://127.0.0.1:{ln.rollout_port + i}" for i in range(ln.rollout_replicas)]

    @property
    def trainer_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.launch.trainer_metrics_port}"

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.cli", *args, "--config", str(self.config_path)]

    def plan(self) -> list[list[Proc]]:
        """Stages of processes, each stage healthy before the next starts."""
        ln, model, run = self.cfg.launch, str(Path(self.cfg.model.path).resolve()), self.cfg.run
        rewards = [Proc(f"reward-{i}", self._cli("reward", "--port", str(ln.reward_port + i)), f"{url}/healthz")
                   for i, url in enumerate(self.reward_urls)]  # fmt: skip
        engines = [] if ln.engine_urls else [
            Proc(f"engine-{i}", self._engine_cmd(model, ln.engine_port + i), f"{url}/health")
            for i, url in enumerate(self.engine_urls)
        ]  # fmt: skip
        rollouts = [
            Proc(f"rollout-{i}", self._cli(
                "rollout", "--port", str(ln.rollout_port + i), "--redis-url", self.redis_url, "--run", run.id,
                "--replica", f"rollout-{i}", "--engine-urls", ",".join(self.engine_urls),
                "--reward-url", self.reward_urls[i % len(self.reward_urls)], "--tokenizer", model,
                "--run-dir", str(self.run_dir)), f"{url}/healthz")
            for i, url in enumerate(self.rollout_urls())
        ]  # fmt: skip
        stages = [rewards, engines, rollouts]
        if ln.trainer:
            trainer = Proc("trainer", [
                sys.executable, "-m", "services.cli", "train", "--nproc-per-node", str(ln.trainer_nproc_per_node),
                "--config", str(self.config_path), "--redis-url", self.redis_url, "--run", run.id,
                "--model-path", model, "--output-dir", str(self.run_dir / "trainer"),
                "--metrics-port", str(ln.trainer_metrics_port)], f"{self.trainer_url}/healthz")  # fmt: skip
            stages.append([trainer])
        return [s for s in stages if s]

    def _engine_cmd(self, model: str, port: int) -> list[str]:
        ln = self.cfg.launch
        if ln.engine_kind == "sglang":  # a real SGLang server (GPU); the rollout speaks its native API
            return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
                    "--port", str(port), "--enable-metrics", *ln.engine_args]  # fmt: skip
        return [*self._cli("engine", "--model", model, "--port", str(port)), *ln.engine_args]

    def submit_dataset(self) -> None:
        sub = self.cfg.submit
        if sub is None:
            return
        cmd = [sys.executable, "-m", "services.cli", "submit", str(Path(sub.file).resolve()), "--url", self.rollout_urls()[0]]
        for flag, value in (("--group-size", sub.group_size), ("--idempotency-key", sub.idempotency_key)):
            if value is not None:
                cmd += [flag, str(value)]
        for flag, obj in (("--sampling-params", sub.sampling_params), ("--reward-spec", sub.reward_spec)):
            if obj is not None:
                cmd += [flag, json.dumps(obj)]
        self._say("launcher", f"submitting {sub.file}")
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        for line in (out.stdout + out.stderr).splitlines():
            self._say("submit", line)
        if out.returncode != 0:
            raise RuntimeError(f"asyncrl submit {sub.file} failed with {out.returncode}")

    # ------------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        m = self.cfg.model
        if m.build_tiny and not (Path(m.path) / "config.json").exists():
            from services.common.tinymodel import DEFAULT_CHARS, build_tiny_model

            self._say("launcher", f"building tiny model in {m.path}")
            build_tiny_model(m.path, chars=m.tiny_chars or DEFAULT_CHARS, hidden_size=m.tiny_hidden_size,
                             num_layers=m.tiny_layers, tie_word_embeddings=m.tiny_tie_embeddings, seed=m.seed)  # fmt: skip
        if not self.redis_url:
            from buffer.server import ensure_redis

            self.redis_url, self.redis = ensure_redis(self.run_dir)
            self._say("launcher", f"embedded Redis at {self.redis_url}")

    def start(self) -> None:
        for proc in (p for stage in self.plan() for p in stage):
            _check_port_free(proc)
        self.prepare()
        env = {**os.environ, "REDIS_URL": self.redis_url, "ASYNCRL_RUN": self.cfg.run.id,
               "ASYNCRL_RUN_DIR": str(self.run_dir), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        for stage in self.plan():
            for proc in stage:
                log = open(self.run_dir / "logs" / f"{proc.name}.log", "ab")  # noqa: SIM115 — _pump closes it
                proc.popen = subprocess.Popen(proc.cmd, env={**env, **proc.env}, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                threading.Thread(target=self._pump, args=(proc, log), daemon=True).start()
                self.procs.append(proc)
            for proc in stage:
                self._wait_healthy(proc)

    def _pump(self, proc: Proc, log) -> None:
        for line in iter(proc.popen.stdout.readline, b""):
            log.write(line)
            log.flush()
            self._say(proc.name, line.decode(errors="replace").rstrip())
        log.close()

    def _say(self, name: str, line: str) -> None:
        if self.echo:
            with self._lock:
                print(f"[{name}] {line}", flush=True)

    def _wait_healthy(self, proc: Proc) -> None:
        deadline = time.monotonic() + self.cfg.launch.health_timeout_s
        while time.monotonic() < deadline:
            if not proc.alive:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was healthy "
                                   f"(see {self.run_dir / 'logs' / (proc.name + '.log')})")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(proc.health_url, timeout=2.0).status_code == 200:
                    self._say("launcher", f"{proc.name} healthy ({proc.health_url})")
                    return
            time.sleep(0.25)
        raise RuntimeError(f"{proc.name} not healthy after {self.cfg.launch.health_timeout_s:.0f} s")

    def find(self, name: str) -> Proc | None:
        return next((p for p in self.procs if p.name == name), None)

    def stop(self) -> None:
        """Reverse order of start: rollout first (no new work), trainer, engines, rewards, Redis."""
        order = ["rollout", "trainer", "engine", "reward"]
        for prefix in order:
            group = [p for p in self.procs if p.name.startswith(prefix) and p.alive]
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in group:
                try:
                    p.popen.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self._say("launcher", f"{p.name} ignored SIGTERM; killing it")
                # whatever the process group still holds (torchrun ranks, workers) goes too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _check_port_free(proc: Proc) -> None:
    """Refuse to start when a service's port is taken: its health check would answer for the
    other process (e.g. a previous run still up) and the launcher would trust the wrong service."""
    if not proc.health_url:
        return
    url = urlsplit(proc.health_url)
    if url.port is None:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            s.bind((url.hostname or "127.0.0.1", url.port))
        except OSError as exc:
            raise RuntimeError(f"port {url.port} for {proc.name} is already in use ({exc.strerror}); "
                               "is another run still up? stop it or choose other ports in [launch]") from None  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl up", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="run config (TOML), e.g. configs/demo.toml")
    args = parser.parse_args(argv)
    cfg = UpConfig.load(args.config)
    launcher = Launcher(cfg, args.config)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C
    code = 0
    try:
        launcher.start()
        launcher._say("launcher", "all services healthy; Ctrl-C stops everything")
        launcher.submit_dataset()
        trainer = launcher.find("trainer")
        while True:
            if trainer is not None and not trainer.alive:
                code = trainer.popen.returncode
                launcher._say("launcher", f"trainer exited with {code}; shutting down")
                break
            dead = [p.name for p in launcher.procs if not p.alive]
            if dead:
                launcher._say("launcher", f"{', '.join(dead)} exited; shutting down")
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        launcher._say("launcher", "interrupted; shutting down")
    except RuntimeError as exc:
        launcher._say("launcher", f"error: {exc}")
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
    return code
