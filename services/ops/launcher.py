"""`asyncrl up --config configs/X.toml`: launch a local topology and supervise it.

Validates the whole TOML file first (services/ops/run_config.py): a bad table or field is
refused, named, before any process starts. Reads `[run]`, `[model]` and `[launch]`; every
service also gets `--config FILE` and reads its own table (`[engine]`, `[rollout]`, `[reward]`,
`[trainer]`).
Starts, in order: Redis (embedded when no URL is given), reward replicas, engines (unless
external `engine_urls` are given), rollout replicas, the trainer (torchrun); health-checks each
before the next; streams every log line with a `[name]` prefix (and into `run_dir/logs/`);
stops in the reverse order on Ctrl-C, on SIGTERM, or when the trainer exits with 0 (it
reached `max_steps`, or was told to stop).

GPU placement (services/ops/placement.py, `Launcher.placement`): on a machine with GPUs every process
gets CUDA_VISIBLE_DEVICES: started engines GPUs 0..k-1 (`engine_tp` each, SGLang's --tp-size),
the trainer the next `trainer_nproc_per_node`, every other process none; `engine_gpus` /
`trainer_gpus` choose others. A GPU given to two processes is refused before anything starts
unless `allow_shared_gpus`; the placement is logged. A `distributed` weight publish over NCCL is
refused, shared or not, when its group would hold two ranks on one GPU or an engine on the CPU
(`check_nccl_weight_group`). Without GPUs nothing changes.

Supervision (`Launcher.supervise`): a service that exits, or stops answering its health check
for `liveness_failures` probes in a row, is restarted with the same command after an
exponential backoff (`restart_backoff_s`, doubling per restart of that service, at most
`restart_backoff_max_s`); the embedded Redis is restarted in place from its AOF (same port,
same directory). Each service may be restarted `max_restarts` times; one more crash stops the
run with a message naming the service. Trainer workers are restarted by torchrun itself
(`trainer_max_restarts`, each restart resuming from the last checkpoint); the launcher
restarts torchrun when it exits non-zero. The clients ride out a Redis restart
(buffer/connection.py, `redis_reconnect_s`). Restarts are logged (`[launcher]` lines, also in
`run_dir/logs/launcher.log`) and exported on `http://127.0.0.1:<metrics_port>/metrics`:
`asyncrl_launcher_restarts_total{service}`, `asyncrl_launcher_service_up{service}`,
`asyncrl_launcher_health_check_failures_total{service}` and `asyncrl_launcher_max_restarts`. torchrun's own worker restarts show on the trainer's /metrics
as `asyncrl_trainer_worker_restarts`.

Before the first process starts, `run_dir/prometheus.yml` (services/ops/scrape.py) is written:
a scrape config with a job per kind of service on the ports above, the launcher's own included;
its `prometheus --config.file=…` command is logged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from asyncrl.services.ops.placement import (
    Placement,
    PlacementError,
    check_nccl_weight_group,
    place,
    visible_gpus,
)
from asyncrl.services.ops.run_config import RunConfig, RunConfigError, load_run_config
from asyncrl.services.ops.scrape import write_scrape_config
from asyncrl.services.runtime import auth
from asyncrl.services.runtime.cores import cpu_count
from asyncrl.services.runtime.metrics import serve_metrics

STOP_GRACE_S = 15.0
AUTO_CORE_SHARE_MAX_CORES = 4  # `[launch] core_share = "auto"`: on at most this many cores
PROBE_TIMEOUT_S = 2.0  # one liveness probe; a service too busy to answer this fast is failing one
STARTING_PROBE_TIMEOUT_S = 0.5  # health polls of a restarted service, once per supervision round


@dataclass
class Proc:
    name: str
    cmd: list[str]
    health_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    # supervision state
    restarts: int = 0
    restart_at: float | None = None  # monotonic time a scheduled restart is due
    started_at: float = 0.0
    healthy: bool = False
    failed_probes: int = 0
    next_probe: float = 0.0
    killed_because: str | None = None  # the launcher killed it (liveness); said when it is restarted

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Launcher:
    def __init__(self, cfg: RunConfig, config_path: Path, *, echo: bool = True):
        if cfg.model is None:
            raise ValueError("[model]: a launched topology needs this table (the model's path)")
        self.cfg, self.config_path, self.echo = cfg, config_path.resolve(), echo
        self.run_dir = Path(cfg.run.dir).resolve()
        self.procs: list[Proc] = []
        self.redis = None
        self.redis_url = cfg.run.redis_url
        self.redis_proc: Proc | None = None  # the embedded Redis, supervised like a service
        self.stop_reason: str | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        # Engines always require a token (services/runtime/auth.py): the operator's, else a random
        # one made for this run; every process started gets it as ASYNCRL_ENGINE_API_TOKEN.
        self.engine_token = auth.engine_token() or auth.generate_token()
        self._metrics_server: ThreadingHTTPServer | None = None
        self.scrape_config: Path | None = None  # run_dir/prometheus.yml, once start() wrote it
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()  # the launcher's own: not mixed with a library's
        self.m_restarts = Counter(
            "asyncrl_launcher_restarts_total",
            "restarts of a crashed service",
            ["service"],
            registry=self.registry,
        )
        self.m_failed_probes = Counter(
            "asyncrl_launcher_health_check_failures_total",
            "liveness probes a running service did not answer with 200",
            ["service"],
            registry=self.registry,
        )
        self.m_up = Gauge(
            "asyncrl_launcher_service_up",
            "1 while the service runs and answers its health check",
            ["service"],
            registry=self.registry,
        )
        Gauge(
            "asyncrl_launcher_max_restarts",
            "restarts allowed per service ([launch] max_restarts)",
            registry=self.registry,
        ).set(cfg.launch.max_restarts)

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

    def scrape_urls(self) -> dict[str, str]:
        """{service -> base URL of its /metrics}: what services/ops/scrape.py writes for Prometheus.
        External engines are included (both engine kinds serve /metrics); Redis has none."""
        urls = {p.name: p.health_url.rsplit("/", 1)[0] for stage in self.plan() for p in stage}
        for i, url in enumerate(self.cfg.launch.engine_urls):
            urls[f"engine-{i}"] = url
        if self.cfg.launch.metrics_port:
            urls["launcher"] = f"http://127.0.0.1:{self.cfg.launch.metrics_port}"
        return urls

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "asyncrl.services.ops.cli", *args, "--config", str(self.config_path)]

    @functools.cached_property
    def placement(self) -> Placement:
        """GPUs per process (services/ops/placement.py), worked out once, before anything starts:
        started engines on GPUs 0..k-1 unless [engine] device = "cpu" (SGLang always uses GPUs),
        the trainer on the next trainer_nproc_per_node unless [trainer] device = "cpu"."""
        ln, cfg = self.cfg.launch, self.cfg
        engines_on_gpu = not ln.engine_urls and (ln.engine_kind == "sglang" or cfg.engine_on_gpu)
        devices = visible_gpus(ln.gpus, os.environ)
        pinned = ln.engine_kind == "reference" and cfg.engine.device not in ("auto", "cuda", "cuda:0")
        if devices and engines_on_gpu and pinned:
            raise PlacementError(
                f"[engine] device = {cfg.engine.device!r}: each engine sees only its own GPU, "
                "as cuda:0; choose the GPUs with [launch] engine_gpus"
            )
        placed = place(
            devices,
            engines=ln.engines if engines_on_gpu else 0,
            engine_tp=ln.engine_tp,
            trainer_nproc=ln.trainer_nproc_per_node if ln.trainer and cfg.trainer_on_gpu else 0,
            engine_gpus=ln.engine_gpus,
            trainer_gpus=ln.trainer_gpus,
            allow_shared=ln.allow_shared_gpus,
        )
        if ln.trainer and cfg.nccl_weight_group and not ln.engine_urls:
            check_nccl_weight_group(placed, engines_on_gpu=engines_on_gpu)
        return placed

    def plan(self) -> list[list[Proc]]:
        """Stages of processes, each stage healthy before the next starts."""
        ln, model, run = self.cfg.launch, str(Path(self.cfg.model.path).resolve()), self.cfg.run
        gpus = self.placement
        no_gpu = gpus.env(())  # on a GPU machine, a process that uses none sees none
        rewards = [
            Proc(
                f"reward-{i}",
                self._cli("reward", "--port", str(ln.reward_port + i)),
                f"{url}/healthz",
                env=no_gpu,
            )
            for i, url in enumerate(self.reward_urls)
        ]
        share = self.core_share_env()
        engines = (
            []
            if ln.engine_urls
            else [
                Proc(
                    f"engine-{i}",
                    self._engine_cmd(model, ln.engine_port + i),
                    f"{url}/health",
                    env={
                        **(gpus.env(gpus.engines[i]) if gpus.engines else no_gpu),
                        **share.get("engine", {}),
                    },
                )
                for i, url in enumerate(self.engine_urls)
            ]
        )
        rollouts = [
            Proc(
                f"rollout-{i}",
                self._cli(
                    "rollout",
                    "--port",
                    str(ln.rollout_port + i),
                    "--redis-url",
                    self.redis_url,
                    "--run",
                    run.id,
                    "--replica",
                    f"rollout-{i}",
                    "--engine-urls",
                    ",".join(self.engine_urls),
                    "--reward-url",
                    self.reward_urls[i % len(self.reward_urls)],
                    "--tokenizer",
                    model,
                    "--run-dir",
                    str(self.run_dir),
                ),
                f"{url}/healthz",
                env=no_gpu,
            )
            for i, url in enumerate(self.rollout_urls())
        ]
        stages = [rewards, engines, rollouts]
        if ln.trainer:
            trainer = Proc(
                "trainer",
                [
                    sys.executable,
                    "-m",
                    "asyncrl.services.ops.cli",
                    "train",
                    "--nproc-per-node",
                    str(ln.trainer_nproc_per_node),
                    "--max-restarts",
                    str(ln.trainer_max_restarts),
                    "--config",
                    str(self.config_path),
                    "--redis-url",
                    self.redis_url,
                    "--run",
                    run.id,
                    "--model-path",
                    model,
                    "--output-dir",
                    str(self.run_dir / "trainer"),
                    "--metrics-port",
                    str(ln.trainer_metrics_port),
                ],
                f"{self.trainer_url}/healthz",
                env={**gpus.env(gpus.trainer), **share.get("trainer", {})},
            )
            stages.append([trainer])
        return [s for s in stages if s]

    @property
    def core_share(self) -> bool:
        """`[launch] core_share`: whether the engine and the trainer lend each other their core.
        `auto` turns it on for one reference engine and a one-rank trainer, both on the CPU of a
        machine of ≤ 4 cores; the default is off (slower in every run measured so far:
        benchmarks/RESULTS.md, "Core sharing")."""
        ln = self.cfg.launch
        if ln.core_share == "off":
            return False
        eligible = (
            ln.engine_kind == "reference"
            and not ln.engine_urls
            and ln.engines == 1
            and ln.trainer
            and ln.trainer_nproc_per_node == 1
            and self.cfg.trainer.device != "cuda"
            and not any(self.placement.engines)
            and not self.placement.trainer
        )
        if ln.core_share == "on" and not eligible:
            raise RuntimeError(
                "[launch] core_share = on needs one reference engine and a one-rank trainer, both on the "
                "CPU; set it to auto or off"
            )
        return eligible and (ln.core_share == "on" or cpu_count() <= AUTO_CORE_SHARE_MAX_CORES)

    def core_share_env(self) -> dict[str, dict[str, str]]:
        """Per process, the settings that point the engine and the trainer at one shared file."""
        if not self.core_share:
            return {}
        path = str(self.run_dir / "cores")
        return {
            "engine": {"ASYNCRL_ENGINE_CORE_SHARE": path},
            "trainer": {"ASYNCRL_TRAINER_CORE_SHARE": path},
        }

    def _engine_cmd(self, model: str, port: int) -> list[str]:
        ln = self.cfg.launch
        if ln.engine_kind == "sglang":  # a real SGLang server (GPU); the rollout speaks its native API
            # SGLang takes its token on the command line only (visible to local users in `ps`,
            # who can reach its loopback port anyway); it leaves /health and /metrics open too.
            return [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--enable-metrics",
                "--api-key",
                self.engine_token,
                "--tp-size",
                str(ln.engine_tp),
                *self.cfg.engine_lora_args(),
                *ln.engine_args,
            ]
        # The token goes by env (not argv); disk updates are confined to the trainer's weights.
        weights = str(self.run_dir / "trainer" / "weights")
        return [
            *self._cli("engine", "--model", model, "--port", str(port), "--weights-root", weights),
            *self.cfg.engine_lora_args(),  # [trainer.lora]: the engine serves its adapters
            *ln.engine_args,
        ]

    def submit_dataset(self) -> None:
        sub = self.cfg.submit
        if sub is None:
            return
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.services.ops.cli",
            "submit",
            *sub.source_args(),
            "--url",
            self.rollout_urls()[0],
        ]
        for flag, value in (("--group-size", sub.group_size), ("--idempotency-key", sub.idempotency_key)):
            if value is not None:
                cmd += [flag, str(value)]
        for flag, obj in (("--sampling-params", sub.sampling_params), ("--reward-spec", sub.reward_spec)):
            if obj is not None:
                cmd += [flag, json.dumps(obj)]
        what = sub.file or f"reasoning-gym {sub.reasoning_gym.dataset}"
        self._say("launcher", f"submitting {what}")
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        for line in (out.stdout + out.stderr).splitlines():
            self._say("submit", line)
        if out.returncode != 0:
            raise RuntimeError(f"asyncrl submit {what} failed with {out.returncode}")

    # ------------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "cores").unlink(
            missing_ok=True
        )  # core sharing: no slot of an earlier run's processes
        m = self.cfg.model
        if m.build_tiny and not (Path(m.path) / "config.json").exists():
            from asyncrl.services.ops.tinymodel import DEFAULT_CHARS, build_tiny_model

            self._say("launcher", f"building tiny model in {m.path}")
            build_tiny_model(
                m.path,
                chars=m.tiny_chars or DEFAULT_CHARS,
                hidden_size=m.tiny_hidden_size,
                num_layers=m.tiny_layers,
                tie_word_embeddings=m.tiny_tie_embeddings,
                seed=m.seed,
            )
        if not self.redis_url:
            from asyncrl.buffer.server import ensure_redis

            self.redis_url, self.redis = ensure_redis(self.run_dir, fsync=self.cfg.launch.redis_appendfsync)
            self._say("launcher", f"embedded Redis at {self.redis_url}")
            if self.redis is not None:  # (not another process's server for this run dir)
                self.redis_proc = Proc("redis", [], None, popen=self.redis.proc, healthy=True)

    def start(self) -> None:
        ln = self.cfg.launch
        for proc in (p for stage in self.plan() for p in stage):
            _check_port_free(proc)
        if ln.metrics_port:
            _check_port_free(Proc("launcher metrics", [], f"http://127.0.0.1:{ln.metrics_port}/metrics"))
        try:
            auth.check_token(self.engine_token, f"the engine token ({auth.ENGINE_TOKEN_ENV})")
        except auth.WeakToken as exc:
            raise RuntimeError(str(exc)) from None
        self.prepare()
        self._say("launcher", self.placement.describe())
        # GPU indices as nvidia-smi numbers them (CUDA's own default orders by speed), unless set
        self._env = {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            **os.environ,
            auth.ENGINE_TOKEN_ENV: self.engine_token,
            "REDIS_URL": self.redis_url,
            "ASYNCRL_RUN": self.cfg.run.id,
            "ASYNCRL_RUN_DIR": str(self.run_dir),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "ASYNCRL_REDIS_RECONNECT_S": str(ln.redis_reconnect_s),
        }
        if ln.metrics_port:
            self._metrics_server = serve_metrics(
                "127.0.0.1", ln.metrics_port, self.registry, thread_name="launcher-metrics"
            )
        if self.redis_proc is not None:
            self.m_up.labels("redis").set(1)
        self.scrape_config = write_scrape_config(self.run_dir, self.scrape_urls(), run_id=self.cfg.run.id)
        self._say("launcher", f"Prometheus scrape config: prometheus --config.file={self.scrape_config}")
        for stage in self.plan():
            for proc in stage:
                self._spawn(proc)
                self.procs.append(proc)
            for proc in stage:
                self._wait_healthy(proc)
                proc.healthy = True
                self.m_up.labels(proc.name).set(1)

    def _spawn(self, proc: Proc) -> None:
        log = open(self.run_dir / "logs" / f"{proc.name}.log", "ab")  # noqa: SIM115 — _pump closes it
        proc.popen = subprocess.Popen(
            proc.cmd,
            env={**self._env, **proc.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.started_at, proc.healthy, proc.failed_probes = time.monotonic(), False, 0
        threading.Thread(target=self._pump, args=(proc, log), daemon=True).start()

    def _pump(self, proc: Proc, log) -> None:
        for line in iter(proc.popen.stdout.readline, b""):
            log.write(line)
            log.flush()
            self._say(proc.name, line.decode(errors="replace").rstrip())
        log.close()

    def _say(self, name: str, line: str) -> None:
        with self._lock:
            if self.echo:
                print(f"[{name}] {line}", flush=True)
            if name == "launcher" and (self.run_dir / "logs").is_dir():  # the run's own record of restarts
                with open(self.run_dir / "logs" / "launcher.log", "a") as f:
                    f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def _wait_healthy(self, proc: Proc) -> None:
        deadline = time.monotonic() + self.cfg.launch.health_timeout_s
        while time.monotonic() < deadline:
            if not proc.alive:
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode} before it was healthy "
                    f"(see {self.run_dir / 'logs' / (proc.name + '.log')})"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(proc.health_url, timeout=2.0).status_code == 200:
                    self._say("launcher", f"{proc.name} healthy ({proc.health_url})")
                    return
            time.sleep(0.25)
        raise RuntimeError(f"{proc.name} not healthy after {self.cfg.launch.health_timeout_s:.0f} s")

    def find(self, name: str) -> Proc | None:
        return next((p for p in self.procs if p.name == name), None)

    # ------------------------------------------------------------------ supervision
    def supervise(self) -> int | None:
        """One round: restart what crashed once its backoff is over, follow restarted services
        until they answer again, probe the others. None while the run goes on; else its exit
        code, with `stop_reason` saying why: the trainer's 0 when it finished, 1 when a
        service crashed once more than `max_restarts` allows."""
        now = time.monotonic()
        for p in [self.redis_proc, *self.procs] if self.redis_proc is not None else self.procs:
            if p.restart_at is not None:
                if now >= p.restart_at:
                    self._restart(p)
                continue
            if p.alive:
                self._watch(p, now)
                continue
            code = p.popen.returncode
            if p.name == "trainer" and code == 0:
                self.stop_reason = "trainer finished (exit 0)"
                return 0
            why = p.killed_because or f"exited with {code}"
            p.killed_because = None
            if not self._schedule_restart(p, why):
                return 1
        return None

    def _schedule_restart(self, p: Proc, why: str) -> bool:
        ln = self.cfg.launch
        self.m_up.labels(p.name).set(0)
        log = self.run_dir / (
            Path("redis") / "redis.log" if p is self.redis_proc else Path("logs") / f"{p.name}.log"
        )
        if p.restarts >= ln.max_restarts:
            self.stop_reason = (
                f"{p.name} {why} after {p.restarts} restart(s), the most [launch] max_restarts = "
                f"{ln.max_restarts} allows: stopping the run (see {log})"
            )
            self._say("launcher", self.stop_reason)
            return False
        delay = min(ln.restart_backoff_s * 2**p.restarts, ln.restart_backoff_max_s)
        p.restart_at = time.monotonic() + delay
        self._say(
            "launcher",
            f"{p.name} {why}; restart {p.restarts + 1}/{ln.max_restarts} in {delay:.1f} s (see {log})",
        )
        return True

    def _restart(self, p: Proc) -> None:
        p.restart_at = None
        p.restarts += 1
        self.m_restarts.labels(p.name).inc()
        if p is self.redis_proc:
            try:  # blocks this round: every service waits for Redis anyway
                self.redis.start(timeout=self.cfg.launch.health_timeout_s)
                self._say("launcher", f"redis restarted from its AOF at {self.redis_url}")
                self.m_up.labels("redis").set(1)
            except RuntimeError as exc:
                self._say("launcher", f"redis restart failed: {exc}")
            p.popen = self.redis.proc  # dead if the restart failed: the next round counts another crash
            return
        with contextlib.suppress(
            ProcessLookupError, PermissionError
        ):  # what the dead process left in its group
            os.killpg(p.popen.pid, signal.SIGKILL)
        self._spawn(p)
        self._say("launcher", f"{p.name} restarted (restart {p.restarts})")

    def _watch(self, p: Proc, now: float) -> None:
        """A running service: until it answers after a restart, poll it (it has health_timeout_s);
        then probe it every liveness_interval_s and kill it after liveness_failures misses in a row
        (the next round restarts it). The trainer is torchrun's to watch: its /healthz is down
        while torchrun restarts a worker, which may take as long as loading the model."""
        ln = self.cfg.launch
        if p.health_url is None:
            return
        if not p.healthy:
            if _answers(p.health_url, STARTING_PROBE_TIMEOUT_S):
                p.healthy, p.next_probe = True, now + ln.liveness_interval_s
                self.m_up.labels(p.name).set(1)
                self._say("launcher", f"{p.name} healthy again ({p.health_url})")
            elif now - p.started_at > ln.health_timeout_s:
                self._kill(p, f"was not healthy {ln.health_timeout_s:.0f} s after its restart")
            return
        if not ln.liveness_interval_s or p.name == "trainer" or now < p.next_probe:
            return
        p.next_probe = now + ln.liveness_interval_s
        if _answers(p.health_url, PROBE_TIMEOUT_S):
            p.failed_probes = 0
            return
        p.failed_probes += 1
        self.m_failed_probes.labels(p.name).inc()
        self.m_up.labels(p.name).set(0)
        if p.failed_probes >= ln.liveness_failures:
            self._kill(p, f"failed {p.failed_probes} health checks in a row ({p.health_url})")

    def _kill(self, p: Proc, why: str) -> None:
        self._say("launcher", f"{p.name} {why}; killing it")
        p.killed_because = why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGKILL)
        p.popen.wait()

    def stop(self) -> None:
        """Reverse order of start: rollout first (no new work), trainer, engines, rewards, Redis."""
        for p in self.procs:
            p.restart_at = None  # a restart that was due will not happen
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
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None


def _answers(url: str, timeout: float) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=timeout).status_code == 200
    return False


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
            raise RuntimeError(
                f"port {url.port} for {proc.name} is already in use ({exc.strerror}); "
                "is another run still up? stop it or choose other ports in [launch]"
            ) from None


def stop_on_first_signal() -> None:
    """SIGINT and SIGTERM stop the run like Ctrl-C (KeyboardInterrupt), once: the first one
    ignores both from then on, so a second one (`timeout` and `pkill` both signalling, a
    double Ctrl-C) cannot cut the shutdown short and leave services running."""

    def interrupt(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl up", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, required=True, help="run config (TOML), e.g. configs/demo.toml"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_run_config(args.config, require=("model",))
    except RunConfigError as exc:
        print(f"asyncrl up: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(cfg, args.config)
    stop_on_first_signal()
    code = 0
    try:
        launcher.start()
        launcher._say("launcher", "all services healthy; Ctrl-C stops everything")
        launcher.submit_dataset()
        while (outcome := launcher.supervise()) is None:
            time.sleep(0.5)
        code = outcome
        launcher._say("launcher", f"{launcher.stop_reason}; shutting down")
    except KeyboardInterrupt:
        launcher._say("launcher", "interrupted; shutting down")
    except RuntimeError as exc:
        launcher._say("launcher", f"error: {exc}")
        code = 1
    finally:
        for sig in (
            signal.SIGINT,
            signal.SIGTERM,
        ):  # (no signal was received: none may cut the shutdown short)
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
    return code
