"""Run a rollout service as a real uvicorn server on a free loopback port, in a thread of the
calling process (tests and benchmarks; `asyncrl rollout` is the production entry point)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from asyncrl.buffer.server import free_port
from asyncrl.proto.states import JobState
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.runtime.serving import STARTUP_TIMEOUT_S, ThreadServer, serve_app_in_thread

__all__ = ["RunningProcess", "RunningRollout", "free_port", "serve_in_thread", "start_process",
           "start_reward_service", "wait_job"]  # fmt: skip


@dataclass
class RunningRollout:
    url: str
    service: object  # services.rollout.service.RolloutService
    http: ThreadServer

    def stop(self) -> None:
        self.http.stop()


def serve_in_thread(redis_url: str, loaded_tokenizer=None, **fields) -> RunningRollout:
    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.service import RolloutService

    settings = RolloutSettings(
        host="127.0.0.1", port=fields.pop("port", None) or free_port(), redis_url=redis_url, **fields
    )
    service = RolloutService(settings, redis_url, tokenizer=loaded_tokenizer)
    http = serve_app_in_thread(build_app(service), settings.port, "rollout", settings.host)
    return RunningRollout(http.url, service, http)


@dataclass
class RunningProcess:
    url: str
    proc: object  # subprocess.Popen

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except Exception:  # noqa: BLE001 - a process that ignores SIGTERM gets SIGKILL
            self.proc.kill()
            self.proc.wait(timeout=15)


def start_process(
    cmd: list[str], base_url: str, ready_path: str, *, timeout_s: float = STARTUP_TIMEOUT_S, log_path=None
) -> RunningProcess:
    """Start `cmd` (one thread per process: OMP_NUM_THREADS=1); wait until `base_url + ready_path` answers 200."""
    import os
    import subprocess

    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if log_path:
        with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ready_url = base_url + ready_path
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(ready_url, timeout=1.0).status_code == 200:
                return RunningProcess(base_url, proc)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} not ready at {ready_url} within {timeout_s} s")


def start_reward_service(
    port: int | None = None, *, log_path=None, args: tuple[str, ...] = ()
) -> RunningProcess:
    """The real reward service (`asyncrl reward`) in a subprocess; the code verifier is off
    (no sandbox needed for the toy verifiers). `args`: more `asyncrl reward` flags."""
    import sys

    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "reward",
        "--port",
        str(port),
        "--no-code-enabled",
        *args,
    ]
    return start_process(cmd, f"http://127.0.0.1:{port}", "/v1/verifiers", log_path=log_path)


def wait_job(client, job_id: str, *, timeout_s: float = 60.0,
             until=(JobState.done, JobState.failed, JobState.cancelled)) -> dict:  # fmt: skip
    """Poll `GET /v1/rollouts/{id}` until its state is one of `until`; returns the progress."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = client.get(f"/v1/rollouts/{job_id}")
        resp.raise_for_status()
        body = resp.json()
        if body["state"] in until:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {body} after {timeout_s} s")
        time.sleep(0.05)
