"""deploy/k8s/base/fleet_member.py, the script an engine pod joins and leaves the engine fleet
with (its `fleet-member` sidecar runs `join`, the engine's preStop hook `leave`), run as those
would run it, against a real rollout service (router_url set), the real sglang-router 0.3.2
started as deploy/k8s starts it (no worker, /workers behind the API token) and a reference
engine, every route behind the token.

What it proves, with exact values: the engine, started at version 0, is brought to the published
version 1 before the router lists it, and generation through the router answers at version 1;
a second join (a restarted sidecar) changes nothing; a leave takes it out of the fleet and of the
router, and a join after it does nothing; a second leave is done (404); a wrong token is refused
for good (exit 1). What is not run here is a kubelet: the hook's timing and the pod's environment
are the manifests' (tests/static/deploy/test_k8s_topologies.py).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from engine_server import serve_in_thread as serve_engine
from prometheus_client import REGISTRY
from rollout_server import free_port, serve_in_thread, start_process
from waiting import wait_until

from asyncrl.buffer import Buffer, EngineRoster, PolicyVersions
from asyncrl.proto import WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.runtime.auth import API_TOKEN_ENV, ENGINE_TOKEN_ENV

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install sglang-router)")

SCRIPT = Path(__file__).resolve().parents[3] / "deploy/k8s/base/fleet_member.py"
TOKEN = secrets.token_urlsafe(32)
CONTEXT = 64


@pytest.fixture
def stack(tmp_path, monkeypatch, redis_url, run_id):
    """Version 1 published to disk; a router, a rollout managing it and an engine at version 0."""
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)
    monkeypatch.setenv(API_TOKEN_ENV, TOKEN)  # every route of the rollout and the engine needs it
    from transformers import AutoTokenizer

    port = free_port()
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(1) as pool:  # the router starts while the models are built
            router_started = pool.submit(
                start_process,
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--policy", "round_robin", "--log-level", "warn",
                 "--control-plane-api-keys", f"rollout:asyncrl-rollout:admin:{TOKEN}",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                f"http://127.0.0.1:{port}", "/health", log_path=tmp_path / "router.log",
            )  # fmt: skip
            stack.callback(lambda: router_started.exception() or router_started.result().stop())
            models = {v: tmp_path / f"v{v}" for v in (0, 1)}
            for version, path in models.items():
                build_tiny_model(path, seed=version, max_position_embeddings=CONTEXT)
        router = router_started.result()
        PolicyVersions(Buffer(redis_url, run_id)).publish(
            WeightsInfo(version=1, method="disk", path=str(models[1]), published_at=time.time())
        )
        engine = serve_engine(str(models[0]), context_length=CONTEXT)
        stack.callback(engine.stop)
        rollout = serve_in_thread(
            redis_url,
            loaded_tokenizer=AutoTokenizer.from_pretrained(models[0]),
            run=run_id,
            replica="r0",
            router_url=router.url,
            reward_url=f"http://127.0.0.1:{free_port()}",  # no job runs here
            tokenizer=str(models[0]),
            weights_poll_s=0.5,
            engine_probe_s=0.2,
            fleet_join_timeout_s=20,
        )
        stack.callback(rollout.stop)
        yield router, rollout, engine, Buffer(redis_url, run_id)


@pytest.fixture
def member():
    """`member(COMMAND, engine_url, rollout_url, state_dir, log)` runs `fleet_member.py COMMAND`
    with the environment the manifests give it; any still running at the end is killed."""
    started = []

    def run(command: str, engine_url: str, rollout_url: str, state_dir: Path, log: Path, token=TOKEN):
        state_dir.mkdir(exist_ok=True)
        env = {
            "ASYNCRL_FLEET_ROLLOUT_URL": rollout_url,
            "ASYNCRL_FLEET_ENGINE_URL": engine_url,
            "ASYNCRL_FLEET_STATE_DIR": str(state_dir),
            API_TOKEN_ENV: token,
        }
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, str(SCRIPT), command], env=env, stdout=out, stderr=out)
        started.append(proc)
        return proc

    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, as the kubelet stops the sidecar."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=10)


def fleet(rollout) -> dict[str, tuple[str, int | None]]:
    resp = httpx.get(f"{rollout.url}/v1/engines", headers={"Authorization": f"Bearer {TOKEN}"})
    resp.raise_for_status()
    return {e["url"]: (e["state"], e["version"]) for e in resp.json()["engines"]}


def routed(router) -> dict[str, bool]:
    resp = httpx.get(f"{router.url}/workers", headers={"Authorization": f"Bearer {TOKEN}"})
    resp.raise_for_status()
    return {w["url"]: w["is_healthy"] for w in resp.json()["workers"]}


def joined_total() -> float:
    return REGISTRY.get_sample_value("asyncrl_rollout_fleet_changes_total", {"change": "joined"}) or 0.0


def test_an_engine_pod_joins_at_the_current_version_and_leaves(stack, member, tmp_path):
    router, rollout, engine, buf = stack
    state, log = tmp_path / "state", tmp_path / "member.log"
    joined0 = joined_total()
    assert httpx.get(f"{router.url}/workers").status_code == 401  # only the token holder adds workers
    assert (engine.engine.weight_version, fleet(rollout), routed(router)) == ("0", {}, {})

    sidecar = member("join", engine.url, rollout.url, state, log)
    wait_until(
        lambda: fleet(rollout) == {engine.url: ("serving", 1)}, timeout=60, message="the engine joined"
    )
    assert routed(router) == {engine.url: True} and engine.engine.weight_version == "1"
    assert engine.engine.scheduler.stats["generated_tokens"] == 0  # nothing served at version 0
    assert set(EngineRoster(buf).members()) == {engine.url}
    wait_until(lambda: "joined the fleet" in log.read_text(), message="the sidecar logged its join")
    assert sidecar.poll() is None  # it idles: a sidecar that exits is restarted

    generated = httpx.post(
        f"{router.url}/generate",
        json={"text": "ab", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert generated.status_code == 200, generated.text
    assert generated.json()["meta_info"]["weight_version"] == "1"
    assert engine.engine.scheduler.stats["generated_tokens"] == 3

    # A restarted sidecar joins again: answered at once, nothing changes.
    again = member("join", engine.url, rollout.url, state, log)
    wait_until(lambda: log.read_text().count("joined the fleet") == 2, message="the second join answered")
    assert (fleet(rollout), routed(router), joined_total() - joined0) == (
        {engine.url: ("serving", 1)},
        {engine.url: True},
        1,
    )
    assert (stop(sidecar), stop(again)) == (0, 0)

    # The preStop hook: out of the router and the fleet, and no join after it.
    leave = member("leave", engine.url, rollout.url, state, log)
    assert leave.wait(timeout=60) == 0
    assert (fleet(rollout), routed(router), set(EngineRoster(buf).members())) == ({}, {}, set())
    assert f"{engine.url} left the fleet (200)" in log.read_text()
    assert (state / "leaving").read_text() == engine.url
    late = member("join", engine.url, rollout.url, state, log)
    wait_until(lambda: "is leaving: not joining" in log.read_text(), message="the late join gave up")
    assert (fleet(rollout), routed(router), late.poll()) == ({}, {}, None)
    assert stop(late) == 0
    again = member("leave", engine.url, rollout.url, state, log)
    assert again.wait(timeout=60) == 0 and f"{engine.url} left the fleet (404)" in log.read_text()

    # A wrong token is a mistake no retry mends: the sidecar exits, and the kubelet shows it.
    wrong = "not-the-token-" + secrets.token_urlsafe(16)
    refused = member("join", engine.url, rollout.url, tmp_path / "fresh", tmp_path / "wrong.log", token=wrong)
    assert refused.wait(timeout=60) == 1
    assert "refused for good (401)" in (tmp_path / "wrong.log").read_text()
    assert fleet(rollout) == {}
