"""An elastic engine fleet behind the real `sglang-router` (services/rollout/fleet.py): three
reference engines join at start, one is SIGKILLed while it runs a request and one is added
during training, weight versions are published to disk as a trainer would; then the rollout
restarts and finds its fleet in Redis, and an engine leaves through the API.

What it proves, with exact values: every group is buffered exactly once; no token carries a
version that was not loaded where it was sampled (each token's logprob is recomputed under the
weights of its version: a token of the added engine served before it was brought up would say
version 0, which no job ever ran at); the added engine served, starting at the current version;
the update after the kill went only to the live engines (not one update error); the router
lists exactly the serving members after each change."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from prometheus_client import REGISTRY
from rollout_server import free_port, serve_in_thread, start_process, wait_job
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, EngineRoster, Groups, PolicyVersions
from asyncrl.proto import WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.runtime.auth import ENGINE_TOKEN_ENV
from asyncrl.services.runtime.serving import serve_app_in_thread

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install sglang-router)")

torch.set_num_threads(1)

CONTEXT = 128
TOKENS = 40  # per sample: long enough that the engine killed is caught mid-request
TOKEN = "fleet-test-engine-token-7f3a9c"  # the engines' control token (the process engine needs one)
CONTROL = {"Authorization": f"Bearer {TOKEN}"}  # what /v1/engines takes (the rollout sends it to engines)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet_models")
    for version in (0, 1, 2):
        build_tiny_model(root / f"v{version}", seed=version, max_position_embeddings=CONTEXT)
    return {version: str(root / f"v{version}") for version in (0, 1, 2)}


def start_engine_process(model: str, weights_root: str, log_path):
    """`asyncrl engine` in its own process (one that can be SIGKILLed), at the start weights."""
    port = free_port()
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", model, "--port", str(port),
           "--weights-root", weights_root, "--max-running-requests", "4", "--context-length", str(CONTEXT),
           "--log-level", "warning"]  # fmt: skip
    return start_process(cmd, f"http://127.0.0.1:{port}", "/health", log_path=log_path)


def start_router(log_path):
    """sglang-router with no worker: the rollout's fleet adds them."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "round_robin", "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    return start_process(cmd, f"http://127.0.0.1:{port}", "/health", log_path=log_path)


def serve_reward():
    """The reward service's app with the toy `reverse` verifier, in a thread."""
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.reward.verifiers.toy import ReverseVerifier

    verifiers = {"reverse": ReverseVerifier(concurrency=8, timeout_s=10.0)}
    return serve_app_in_thread(
        build_app(RewardSettings(code_enabled=False), verifiers), free_port(), "reward"
    )


def routed(router) -> set[str]:
    """The URLs the router sends requests to (listed and healthy)."""
    workers = httpx.get(f"{router.url}/workers").json()["workers"]
    return {w["url"] for w in workers if w["is_healthy"]}


def fleet(client) -> dict[str, tuple[str, int | None]]:
    return {e["url"]: (e["state"], e["version"]) for e in client.get("/v1/engines").json()["engines"]}


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def logprobs_under(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log μ(token) of each completion token sampled from `model` at `temperature` (the engine
    reports the log-probability under the distribution it drew from)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return (
        torch.log_softmax(logits.float() / temperature, -1)
        .gather(1, torch.tensor(tokens)[:, None])
        .squeeze(1)
    )


def temperature(k: int) -> float:
    return 1.0 - 0.05 * k


def submit(client, jobs: int, suffix: str) -> list[str]:
    """`jobs` jobs of two prompts each. The rollout sends a step's groups with the same sampling
    params as one /generate, and the router sends a request to one engine: jobs with their own
    temperature make requests of their own, which round-robin spreads over every engine."""
    ids = []
    for k in range(jobs):
        body = {
            "prompts": [{"text": f"{a}{'bcdefg'[k]}{suffix}>"} for a in "xy"],
            "group_size": 2,
            "reward_spec": {"verifier": "reverse"},
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": temperature(k)},
        }
        resp = client.post("/v1/rollouts", json=body)
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["job_id"])
    return ids


@pytest.fixture
def parts(models, tmp_path, monkeypatch):
    """The victim (an engine process), the router (a process), two steady engines, the spare
    and the reward service (threads), all at version 0; each stopped at the end, started or not."""
    monkeypatch.setenv(ENGINE_TOKEN_ENV, TOKEN)
    weights_root = str(Path(models[0]).parent)  # holds every version's directory
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:  # the processes start while the in-thread services load
            victim_started = pool.submit(
                start_engine_process, models[0], weights_root, tmp_path / "victim.log"
            )
            router_started = pool.submit(start_router, tmp_path / "router.log")
            stack.callback(
                lambda: [p.result().stop() for p in (victim_started, router_started) if not p.exception()]
            )
            threads = [
                serve_engine(models[0], max_running_requests=4, context_length=CONTEXT) for _ in range(3)
            ]
            threads.append(serve_reward())
            stack.callback(lambda: [t.stop() for t in threads])
        yield victim_started.result(), router_started.result(), threads[:2], threads[2], threads[3]


def test_engines_join_die_and_leave_behind_sglang_router(parts, models, redis_url, run_id):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    victim, router, steady, spare, reward = parts
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=64, max_staleness=2)
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    members = [victim.url, *(e.url for e in steady)]
    settings = {"run": run_id, "replica": "r0", "router_url": router.url, "engine_admin_urls": ",".join(members),
                "reward_url": reward.url, "tokenizer": models[0], "max_new_tokens_cap": 64,
                "default_max_new_tokens": 8, "claim_poll_s": 0.05, "admission_poll_s": 0.05, "weights_poll_s": 0.5,
                "engine_probe_s": 0.2, "engine_unhealthy_after": 2, "engine_backoff_s": 0.05,
                "requeue_backoff_max_s": 0.5, "fleet_join_timeout_s": 20}  # fmt: skip
    errors0 = metric("asyncrl_rollout_weight_updates_total", method="disk", result="error")
    changes0 = {
        c: metric("asyncrl_rollout_fleet_changes_total", change=c) for c in ("joined", "down", "left")
    }
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **settings)
    try:
        with httpx.Client(base_url=running.url, timeout=60, headers=CONTROL) as client:
            # At start the configured engines join: the router gets them from the rollout.
            wait_until(lambda: fleet(client) == dict.fromkeys(members, ("serving", 0)), timeout=30,
                       message="the three engines joined")  # fmt: skip
            assert routed(router) == set(members)
            publish(buf, models, 1)
            wait_until(lambda: fleet(client) == dict.fromkeys(members, ("serving", 1)), timeout=30,
                       message="the fleet serves version 1")  # fmt: skip

            first = submit(client, 6, "h")

            def victim_busy() -> bool:
                info = httpx.get(f"{victim.url}/get_server_info").json()["internal_states"][0]
                return info["num_running_reqs"] > 0

            wait_until(victim_busy, timeout=30, interval=0.005, message="the victim runs a request")
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=10)
            wait_until(
                lambda: fleet(client)[victim.url][0] == "down", timeout=30, message="the victim is down"
            )
            assert routed(router) == {e.url for e in steady}

            # The spare starts at version 0 and has served nothing; it joins at version 1.
            assert (spare.engine.weight_version, spare.engine.scheduler.stats["generated_tokens"]) == ("0", 0)
            joined = client.post("/v1/engines", json={"url": spare.url + "/"})
            assert joined.status_code == 200, joined.text
            assert {k: joined.json()[k] for k in ("url", "state", "version")} == {
                "url": spare.url, "state": "serving", "version": 1}  # fmt: skip
            assert spare.engine.weight_version == "1" and routed(router) == {
                spare.url,
                *(e.url for e in steady),
            }

            publish(buf, models, 2)
            live = [spare.url, *(e.url for e in steady)]
            wait_until(lambda: all(fleet(client)[u] == ("serving", 2) for u in live), timeout=30,
                       message="the live engines serve version 2")  # fmt: skip
            second = submit(client, 4, "i")
            progress = [wait_job(client, job_id) for job_id in first + second]
            assert [(p["buffered"], p["failed"], p["cancelled"]) for p in progress] == [(2, 0, 0)] * 10
            assert fleet(client)[victim.url] == ("down", None)
    finally:
        running.stop()

    assert metric("asyncrl_rollout_weight_updates_total", method="disk", result="error") == errors0
    assert {c: metric("asyncrl_rollout_fleet_changes_total", change=c) - changes0[c] for c in changes0} == {
        "joined": 4, "down": 1, "left": 0}  # fmt: skip
    assert spare.engine.scheduler.stats["generated_tokens"] > 0  # the spare served

    # Exact accounting: 20 groups, each once, no more.
    groups = Groups(buf, "test-trainer").take(21, current_version=2, max_staleness=10, block_ms=1000).groups
    assert len(groups) == 20 and len({g.group_id for g in groups}) == 20
    temperatures = {job_id: temperature(k) for ids in (first, second) for k, job_id in enumerate(ids)}
    weights = {v: AutoModelForCausalLM.from_pretrained(models[v]).eval() for v in (1, 2)}
    for g in groups:
        prompt = g.prompt_tokens.tolist()
        for s in g.samples:
            versions, tokens = s.versions.tolist(), s.completion_ids.tolist()
            assert len(tokens) == TOKENS and set(versions) <= {1, 2}, versions
            if g.job_id in second:  # submitted when every live engine served version 2
                assert set(versions) == {2}
            for v in set(versions):
                mine = [t for t in range(TOKENS) if versions[t] == v]
                got = torch.from_numpy(s.behavior_logprobs[mine].astype(np.float32))
                want = logprobs_under(weights[v], prompt, tokens, temperatures[g.job_id])[mine]
                assert torch.allclose(got, want, atol=1e-4), (v, (got - want).abs().max())

    # A restarted rollout finds the spare in Redis; the killed engine, still configured, is down.
    restarted = serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **settings)
    try:
        with httpx.Client(base_url=restarted.url, timeout=60, headers=CONTROL) as client:
            want = {victim.url: ("down", None), **dict.fromkeys(live, ("serving", 2))}
            wait_until(lambda: fleet(client) == want, timeout=30, message="the restarted rollout's fleet")
            assert routed(router) == set(live)

            left = client.delete("/v1/engines", params={"url": spare.url})
            assert left.status_code == 200, left.text
            assert {e["url"] for e in left.json()["engines"]} == {victim.url, *(e.url for e in steady)}
            assert routed(router) == {e.url for e in steady}
            assert set(EngineRoster(buf).members()) == set()  # the configured engines are not in the roster

            assert client.delete("/v1/engines", params={"url": spare.url}).status_code == 404
            assert client.delete("/v1/engines", params={"url": "ftp://x"}).status_code == 422
            nobody = f"http://127.0.0.1:{free_port()}"
            refused = client.post("/v1/engines", json={"url": nobody})
            assert refused.status_code == 409 and "loading version 2" in refused.json()["detail"], (
                refused.text
            )
            assert nobody not in fleet(client) and nobody not in EngineRoster(buf).members()
    finally:
        restarted.stop()


def publish(buf: Buffer, models: dict[int, str], version: int) -> None:
    PolicyVersions(buf).publish(
        WeightsInfo(version=version, method="disk", path=models[version], published_at=time.time())
    )
