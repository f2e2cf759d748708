"""LoRA versions through the rollout service on loopback: real Redis (fixture), reference
engines with LoRA on (uvicorn threads, a tiny Qwen2), real PEFT adapters (tests/peft_adapters.py)
announced as a `[trainer.lora]` trainer announces them, the real reward service (`asyncrl
reward` subprocess, toy `reverse` verifier), the rollout service over HTTP. Nothing is mocked.

Covers: an announced LoRA version is loaded on the engine, the next group's requests name it and
its tokens carry that version with the adapter's log-probs (not the base model's), and an
evaluation names it too; an adapter a long request in flight uses survives three newer
versions and is unloaded once that request ends; a version whose adapter one of two engines
fails to load is never sampled there (counted, retried); an engine restarted without its
adapters gets them again and no base-model token is labelled as the policy's; with
`weight_update_abort` a newer version aborts the requests naming an older one, which go on
under it (partial rollouts); a group whose engine fails goes on on another from its last
segment, naming that engine's newest adapter.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from peft_adapters import save_peft_adapter, teacher_forced_logprobs
from prometheus_client import REGISTRY
from rollout_server import free_port, serve_in_thread, start_reward_service, wait_job
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.proto import WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.transport.weights import adapter_name

torch.set_num_threads(1)

CONTEXT = 128
CAP = 100
LETTERS = "abcdefghij"
TOLERANCE = 1e-3  # the engine's adapter log-probs against PEFT's (fp32 on the CPU: ~1e-6)
MOVED = 0.05  # an adapter (lora_B ~ N(0, 0.3)) moves some log-prob by at least this from the base's


def word(i: int, k: int = 4) -> str:
    return "".join(LETTERS[(i * 7 + j * 3) % len(LETTERS)] for j in range(k))


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lora_rollout_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict:
    """Versions 1-4 as PEFT adapter directories under one root; version 1 also under `root/b`,
    the only part of the root engine B of the two-engine test may read."""
    root = tmp_path_factory.mktemp("lora_rollout_adapters")
    paths = {1: root / "b" / "v1"}
    paths.update({v: root / f"v{v}" for v in (2, 3, 4)})
    for v, path in paths.items():
        save_peft_adapter(model_dir, path, targets="all-linear", seed=100 + v)
    return {"root": root, **paths}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(log_path=tmp_path_factory.mktemp("reward") / "reward.log")
    yield running
    running.stop()


def start_engine(model_dir: str, root: Path, port: int | None = None):
    return serve_engine(model_dir, max_running_requests=32, max_new_tokens_cap=CAP, context_length=CONTEXT,
                        weights_root=str(root), enable_lora=True, max_lora_rank=8, lora_target_modules="all",
                        port=port)  # fmt: skip


def settings(engine_urls: str, reward_url: str, model_dir: str, run: str, **extra) -> dict:
    base = {
        "run": run,
        "replica": "r0",
        "engine_urls": engine_urls,
        "reward_url": reward_url,
        "tokenizer": model_dir,
        "max_new_tokens_cap": CAP,
        "default_max_new_tokens": 8,
        "heartbeat_s": 0.3,
        "recover_idle_s": 1.5,
        "recover_interval_s": 0.3,
        "claim_poll_s": 0.05,
        "admission_poll_s": 0.05,
        "weights_poll_s": 0.5,
        "engine_backoff_s": 0.05,
    }
    return {**base, **extra}


@contextlib.contextmanager
def rollout_on(engine_urls: str, redis_url, run_id, reward, model_dir, tokenizer, **extra):
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=64, max_staleness=100)
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **settings(engine_urls, reward.url, model_dir, run_id, **extra))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            yield buf, client
    finally:
        running.stop()
        buf.close()


def announce(buf: Buffer, run: str, version: int, path: Path) -> str:
    """What a `[trainer.lora]` trainer announces for `version` (trainer/publish.py)."""
    name = adapter_name(run, version)
    info = WeightsInfo(version=version, method="disk", kind="lora", adapter_name=name, path=str(path),
                       published_at=time.time())  # fmt: skip
    PolicyVersions(buf).publish(info, set_version=True)
    return name


def loaded(url: str) -> list[str]:
    """The adapters requests may name, as the engine's /v1/models lists them."""
    return sorted(card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"][1:])


def adapter_state(url: str) -> dict[str, dict]:
    return {a["name"]: a for a in httpx.get(f"{url}/server_info").json()["lora_adapters"]}


def generated_tokens(url: str) -> int:
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]["generated_tokens"]


def submit(client: httpx.Client, prompts: int, group_size: int, tokens: int) -> str:
    body = {
        "prompts": [{"text": word(i) + ">"} for i in range(prompts)],
        "group_size": group_size,
        "reward_spec": {"verifier": "reverse"},
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
    }
    resp = client.post("/v1/rollouts", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["job_id"]


def take(buf: Buffer, n: int) -> list:
    return Groups(buf, "test-trainer").take(n, current_version=PolicyVersions(buf).version(),
                                            max_staleness=10**6, block_ms=2000).groups  # fmt: skip


def assert_sampled_by(group, model_dir: str, adapter_dir: Path, version: int) -> float:
    """Every token of `group` carries `version` and has the log-prob of the base model with that
    adapter; returns the largest distance of those log-probs from the base model's alone."""
    prompt = group.prompt_tokens.tolist()
    moved = 0.0
    for s in group.samples:
        tokens = s.completion_ids.tolist()
        assert s.versions.tolist() == [version] * len(tokens)
        want = teacher_forced_logprobs(model_dir, adapter_dir, prompt, tokens)
        got = torch.from_numpy(s.behavior_logprobs.astype(np.float32))
        assert torch.allclose(got, want, atol=TOLERANCE), (got - want).abs().max()
        base = teacher_forced_logprobs(model_dir, None, prompt, tokens)
        moved = max(moved, float((got - base).abs().max()))
    return moved


def test_an_announced_version_is_loaded_and_named_by_the_next_groups_and_evaluations(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    engine = start_engine(model_dir, adapters["root"])
    try:
        with rollout_on(engine.url, redis_url, run_id, reward, model_dir, tokenizer) as (buf, client):
            name = announce(buf, run_id, 1, adapters[1])
            wait_until(lambda: loaded(engine.url) == [name], timeout=30, message="the adapter is loaded")
            job_id = submit(client, prompts=2, group_size=3, tokens=6)
            assert wait_job(client, job_id)["buffered"] == 2
            groups = take(buf, 2)
            assert adapter_state(engine.url)[name]["requests"] == 6  # each of the 6 samples named it

            prompts = [{"text": word(i) + ">", "reward_spec": {"verifier": "reverse"}} for i in range(3)]
            resp = client.post("/v1/evaluations", json={"name": "lora", "prompts": prompts})
            assert resp.status_code == 202, resp.text
            result = wait_until(
                lambda: (
                    (r := client.get(f"/v1/evaluations/{resp.json()['eval_id']}").json())["state"]
                    in ("done", "failed")
                    and r
                ),
                timeout=60,
                message="the evaluation ends",
            )
            assert result["state"] == "done" and result["version"] == 1, result
            assert adapter_state(engine.url)[name]["requests"] == 9  # and so did its 3 items
    finally:
        engine.stop()
    assert len(groups) == 2 and all(g.min_version == 1 for g in groups)
    assert max(assert_sampled_by(g, model_dir, adapters[1], 1) for g in groups) > MOVED


def in_the_middle(engine, requests: int, tokens: int) -> bool:
    """All `requests` decode on the engine and each has sampled at least `tokens` tokens."""
    running = list(engine.engine.scheduler.running)  # a snapshot; the scheduler thread mutates it
    return len(running) == requests and min(len(r.output_ids) for r in running) >= tokens


def test_an_adapter_in_use_survives_three_newer_versions_and_goes_once_its_request_ends(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    """One adapter kept per engine (`max_loaded_adapters = 1`), requests finishing under the
    adapter they named (`weight_update_abort = false`): the long request's version 1 stays while
    versions 2, 3 and 4 arrive (2 and 3 are unloaded as 3 and 4 come), serves the request to its
    end, and goes once it is answered."""
    engine = start_engine(model_dir, adapters["root"])
    unloads0 = metric("asyncrl_rollout_adapter_unloads_total", result="ok")
    try:
        with (
            rollout_on(engine.url, redis_url, run_id, reward, model_dir, tokenizer, max_loaded_adapters=1,
                       weight_update_abort=False) as (buf, client),
            httpx.Client(base_url=engine.url, timeout=30) as eng,
        ):  # fmt: skip
            names = {1: announce(buf, run_id, 1, adapters[1])}
            wait_until(lambda: loaded(engine.url) == [names[1]], timeout=30, message="version 1 is loaded")
            job_id = submit(client, prompts=1, group_size=1, tokens=60)
            wait_until(
                lambda: in_the_middle(engine, 1, 4), timeout=30, interval=0.002, message="it generates"
            )
            assert eng.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            for v in (2, 3, 4):
                names[v] = announce(buf, run_id, v, adapters[v])
                wait_until(lambda v=v: loaded(engine.url) == sorted([names[1], names[v]]), timeout=30,
                           message=f"version {v} is loaded beside version 1, the ones between unloaded")  # fmt: skip
            assert adapter_state(engine.url)[names[1]]["in_flight"] == 1
            assert eng.post("/continue_generation", json={}).status_code == 200
            assert wait_job(client, job_id)["buffered"] == 1
            wait_until(lambda: loaded(engine.url) == [names[4]], timeout=30, message="version 1 goes")
            (group,) = take(buf, 1)
    finally:
        engine.stop()
    assert metric("asyncrl_rollout_adapter_unloads_total", result="ok") - unloads0 == 3
    assert len(group.samples[0].completion_ids) == 60
    assert_sampled_by(group, model_dir, adapters[1], 1)


def test_a_version_one_engine_cannot_load_is_never_sampled_there(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    """Engine B reads only `root/b`: it loads version 1, refuses version 2. From then on the
    groups go to engine A, which holds version 2; B samples nothing (not even at version 1),
    and each failed load (the first and the poll's retries) is counted."""
    a = start_engine(model_dir, adapters["root"])
    b = start_engine(model_dir, adapters["root"] / "b")
    try:
        with rollout_on(f"{a.url},{b.url}", redis_url, run_id, reward, model_dir, tokenizer) as (buf, client):
            v1 = announce(buf, run_id, 1, adapters[1])
            wait_until(
                lambda: loaded(a.url) == loaded(b.url) == [v1], timeout=30, message="both hold version 1"
            )
            failures0 = metric("asyncrl_rollout_adapter_load_failures_total", engine="1")
            b_tokens = generated_tokens(b.url)
            v2 = announce(buf, run_id, 2, adapters[2])
            wait_until(lambda: v2 in loaded(a.url), timeout=30, message="A holds version 2")
            wait_until(lambda: metric("asyncrl_rollout_adapter_load_failures_total", engine="1") >= failures0 + 2,
                       timeout=30, message="B's load failed, and so did a retry")  # fmt: skip
            job_id = submit(client, prompts=6, group_size=2, tokens=5)
            assert wait_job(client, job_id)["buffered"] == 6
            groups = take(buf, 6)
            assert loaded(b.url) == [v1]
            assert generated_tokens(b.url) == b_tokens
            assert adapter_state(a.url)[v2]["requests"] == 12
    finally:
        a.stop()
        b.stop()
    assert len(groups) == 6
    for g in groups:
        assert_sampled_by(g, model_dir, adapters[2], 2)


def test_an_engine_restarted_without_its_adapters_gets_them_again(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    """The engine restarts (same URL, no adapter): the next request names version 1, is refused
    as "not loaded", the rollout loads version 1 again and sends it again. Its tokens are the
    adapter's, labelled 1; none comes from the base model."""
    port = free_port()
    engine = start_engine(model_dir, adapters["root"], port=port)
    try:
        with rollout_on(engine.url, redis_url, run_id, reward, model_dir, tokenizer) as (buf, client):
            name = announce(buf, run_id, 1, adapters[1])
            wait_until(lambda: loaded(engine.url) == [name], timeout=30, message="the adapter is loaded")
            assert wait_job(client, submit(client, prompts=1, group_size=2, tokens=4))["buffered"] == 1
            take(buf, 1)
            engine.stop()
            engine = start_engine(model_dir, adapters["root"], port=port)
            assert loaded(engine.url) == []
            lost0 = metric("asyncrl_rollout_adapter_lost_total")
            job_id = submit(client, prompts=2, group_size=2, tokens=6)
            assert wait_job(client, job_id)["buffered"] == 2
            groups = take(buf, 2)
            assert loaded(engine.url) == [name]
            assert metric("asyncrl_rollout_adapter_lost_total") >= lost0 + 1
    finally:
        engine.stop()
    assert max(assert_sampled_by(g, model_dir, adapters[1], 1) for g in groups) > MOVED


def test_a_newer_version_aborts_the_requests_naming_an_older_one_and_they_go_on_under_it(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    """`weight_update_abort` (the default) with LoRA: once version 2 is loaded, the requests in
    flight naming version 1 are aborted and their remainders go again naming version 2 (partial
    rollouts, as with full weights): each sample's tokens are version 1's then version 2's,
    each with its own adapter's log-prob. (The engine is paused mid-sequence so that the
    announcement finds the requests running.)"""
    engine = start_engine(model_dir, adapters["root"])
    aborts0 = metric("asyncrl_rollout_aborts_total")
    try:
        with (
            rollout_on(engine.url, redis_url, run_id, reward, model_dir, tokenizer) as (buf, client),
            httpx.Client(base_url=engine.url, timeout=30) as eng,
        ):
            v1 = announce(buf, run_id, 1, adapters[1])
            wait_until(lambda: loaded(engine.url) == [v1], timeout=30, message="version 1 is loaded")
            job_id = submit(client, prompts=1, group_size=2, tokens=40)
            wait_until(
                lambda: in_the_middle(engine, 2, 4), timeout=30, interval=0.002, message="it generates"
            )
            assert eng.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            announce(buf, run_id, 2, adapters[2])
            wait_until(lambda: metric("asyncrl_rollout_aborts_total") >= aborts0 + 2, timeout=30,
                       message="both requests come back aborted")  # fmt: skip
            assert eng.post("/continue_generation", json={}).status_code == 200
            assert wait_job(client, job_id)["buffered"] == 1
            (group,) = take(buf, 1)
    finally:
        engine.stop()
    prompt = group.prompt_tokens.tolist()
    for s in group.samples:
        versions, tokens = s.versions.tolist(), s.completion_ids.tolist()
        k = versions.index(2)
        assert len(tokens) == 40 and 4 <= k < 40 and versions == [1] * k + [2] * (40 - k)
        got = torch.from_numpy(s.behavior_logprobs.astype(np.float32))
        for v, span in ((1, slice(0, k)), (2, slice(k, 40))):
            want = teacher_forced_logprobs(model_dir, adapters[v], prompt, tokens)
            assert torch.allclose(got[span], want[span], atol=TOLERANCE), (
                v,
                (got[span] - want[span]).abs().max(),
            )


def test_a_group_whose_engine_fails_goes_on_elsewhere_naming_that_engines_newest_adapter(
    redis_url, run_id, reward, model_dir, adapters, tokenizer
):
    """Engines A and B hold version 1; a group runs on A (listed first). A is frozen mid-sequence
    and version 2 arrives: its requests come back aborted with their version-1 tokens, and their
    remainders, naming version 2, hang on A until they time out. The group moves to B and its
    samples go on from their last segment there, naming B's newest adapter (version 2), as a
    group moves between engines with full weights: the version-1 tokens keep their version and
    log-probs, the rest are version 2's."""
    a = start_engine(model_dir, adapters["root"])
    b = start_engine(model_dir, adapters["root"])
    resumed0 = metric("asyncrl_rollout_failover_resumes_total")
    try:
        with (
            rollout_on(f"{a.url},{b.url}", redis_url, run_id, reward, model_dir, tokenizer, engine_timeout_s=15,
                       engine_retries=0, engine_unhealthy_after=1, engine_probe_s=600,
                       requeue_backoff_max_s=0.2) as (buf, client),
            httpx.Client(base_url=a.url, timeout=30) as eng_a,
        ):  # fmt: skip
            v1 = announce(buf, run_id, 1, adapters[1])
            wait_until(
                lambda: loaded(a.url) == loaded(b.url) == [v1], timeout=30, message="both hold version 1"
            )
            job_id = submit(client, prompts=1, group_size=2, tokens=40)
            wait_until(
                lambda: in_the_middle(a, 2, 4), timeout=30, interval=0.002, message="it generates on A"
            )
            assert eng_a.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            v2 = announce(buf, run_id, 2, adapters[2])
            assert wait_job(client, job_id, timeout_s=90)["buffered"] == 1
            (group,) = take(buf, 1)
            assert adapter_state(b.url)[v2]["requests"] == 2 and adapter_state(b.url)[v1]["requests"] == 0
            eng_a.post("/continue_generation", json={})  # (the timed-out remainders end on A)
    finally:
        a.stop()
        b.stop()
    assert metric("asyncrl_rollout_failover_resumes_total") - resumed0 == 2
    prompt = group.prompt_tokens.tolist()
    for s in group.samples:
        versions, tokens = s.versions.tolist(), s.completion_ids.tolist()
        k = versions.index(2)
        assert len(tokens) == 40 and 4 <= k < 40 and versions == [1] * k + [2] * (40 - k)
        got = torch.from_numpy(s.behavior_logprobs.astype(np.float32))
        for v, span in ((1, slice(0, k)), (2, slice(k, 40))):
            want = teacher_forced_logprobs(model_dir, adapters[v], prompt, tokens)
            assert torch.allclose(got[span], want[span], atol=TOLERANCE), (
                v,
                (got[span] - want[span]).abs().max(),
            )
