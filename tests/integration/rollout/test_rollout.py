"""The rollout service end to end on loopback: real Redis (fixture), the reference engine
(uvicorn thread, tiny Qwen2), the real reward service (`asyncrl reward` subprocess, toy
`reverse` verifier), the rollout service over HTTP. Nothing is mocked; the "garbage engine"
below is a real HTTP server that answers nonsense on purpose (fault injection).

Covers: a 16 × 4 job ends with 16 scored groups with per-token versions; a weight update in
the middle of generation gives samples whose versions change mid-sequence and whose logprobs
match the weights that produced each token; SIGKILL of a replica loses no group; bad input
→ 4xx; idempotency keys; DELETE; engines that are down or answer garbage; a group whose engine
fails mid-sample goes on elsewhere from its last received segment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from prometheus_client import REGISTRY
from rollout_server import free_port, serve_in_thread, start_process, start_reward_service, wait_job
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.buffer import stats as buffer_stats
from asyncrl.proto import RewardStatus, WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 128
CAP = 100
LETTERS = "abcdefghij"


def reverse_reward(target: str, completion: str) -> float:
    """The toy verifier's rule, written out: matched positions / the longer length."""
    return sum(a == b for a, b in zip(completion, target)) / max(len(target), len(completion))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollout_model_v0")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=CAP, context_length=CONTEXT)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(log_path=tmp_path_factory.mktemp("reward") / "reward.log")
    yield running
    running.stop()


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


@pytest.fixture
def rollout(redis_url, run_id, engine, reward, model_dir, tokenizer):
    """A rollout service on a fresh run with room for 64 groups (B = 64, η = 0)."""
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield client
    running.stop()


def trainer_side(redis_url: str, run_id: str, n: int) -> list:
    buf = Buffer(redis_url, run_id)
    return Groups(buf, "test-trainer").take(n, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                            block_ms=2000).groups  # fmt: skip


def word(i: int, k: int = 4) -> str:
    return "".join(LETTERS[(i * 7 + j * 3) % len(LETTERS)] for j in range(k))


# --------------------------------------------------------------------------------- the happy path


def test_job_of_16_prompts_gives_16_scored_groups(rollout, redis_url, run_id, tokenizer):
    prompts = []
    for i in range(16):
        w = word(i)
        if i % 4 == 1:
            prompts.append(
                {
                    "messages": [{"role": "user", "content": w + ">"}],
                    "reward_spec": {"verifier": "reverse", "target": w[::-1]},
                }
            )
        elif i % 4 == 2:
            prompts.append(
                {
                    "input_ids": tokenizer(w + ">")["input_ids"],
                    "reward_spec": {"verifier": "reverse", "target": w[::-1]},
                }
            )
        else:
            prompts.append({"text": w + ">", "reward_spec": {"verifier": "reverse", "target": w[::-1]}})
    resp = rollout.post(
        "/v1/rollouts",
        json={
            "prompts": prompts,
            "group_size": 4,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
        },
    )
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["job_id"]
    assert resp.json()["groups"] == 16

    progress = wait_job(rollout, job_id)
    assert progress["state"] == "done"
    assert (progress["buffered"], progress["queued"], progress["failed"], progress["in_buffer"]) == (
        16,
        0,
        0,
        16,
    )

    groups = trainer_side(redis_url, run_id, 16)
    assert sorted(g.group_id for g in groups) == [f"{job_id}-{i:06d}" for i in range(16)]
    for g in groups:
        i = int(g.group_id.rsplit("-", 1)[1])
        target = word(i)[::-1]
        assert g.reward_spec == {"verifier": "reverse", "target": target}
        assert len(g.samples) == 4 and sorted(s.index for s in g.samples) == [0, 1, 2, 3]
        assert (g.submit_version, g.min_version) == (0, 0)
        for s in g.samples:
            n = len(s.completion_ids)
            assert 1 <= n <= 8
            assert s.versions.tolist() == [0] * n  # the engine serves version "0" throughout
            assert s.finish_reason.value in ("stop", "length")
            assert s.truncated == (s.finish_reason.value == "length")
            assert s.reward_status is RewardStatus.scored
            assert s.reward == pytest.approx(reverse_reward(target, s.text))
            ids = s.completion_ids.tolist()
            shown = ids[:-1] if s.finish_reason.value == "stop" else ids
            assert s.text == tokenizer.decode(shown, skip_special_tokens=True)
            assert s.timings.submitted <= s.timings.finished <= s.timings.scored
    # The chat prompt went through the tokenizer's chat template.
    chat = next(g for g in groups if g.group_id.endswith("-000001"))
    rendered = f"user: {word(1)}>\nassistant: "  # the tiny model's template, rendered by hand
    assert chat.prompt_tokens.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------- partial rollouts


@pytest.fixture
def model_dir_v1(tmp_path):
    path = tmp_path / "model_v1"
    build_tiny_model(path, seed=1, max_position_embeddings=CONTEXT)
    return str(path)


@contextlib.contextmanager
def own_engine_and_rollout(
    redis_url, run_id, reward, model_dir, tokenizer, *, batch_groups: int, max_staleness: int, **extra
):
    """An engine of its own (its weights change under the test) and a rollout service on it."""
    engine = serve_engine(model_dir, max_running_requests=16, max_new_tokens_cap=CAP, context_length=CONTEXT)
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=batch_groups, max_staleness=max_staleness)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id, **extra)
    )
    try:
        yield engine, buf, running
    finally:
        running.stop()
        engine.stop()


def logprobs_under(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log π(token) of each completion token under `model`, in fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_a_group_admitted_as_an_update_starts_samples_only_the_new_weights(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer
):
    """B = 1, η = 0: the second group waits for version 1. The trainer sets the version as it
    announces the weights, so the service admits that group while the engine is still loading
    them; its samples must start only once the engine serves them: every token of version 1,
    with the logprobs of version 1's weights."""
    from transformers import AutoModelForCausalLM

    with (
        own_engine_and_rollout(redis_url, run_id, reward, model_dir, tokenizer, batch_groups=1, max_staleness=0) as (_, buf, running),
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):  # fmt: skip
        body = {"prompts": [{"text": word(i) + ">"} for i in range(2)], "group_size": 3,
                "reward_spec": {"verifier": "reverse"}, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}  # fmt: skip
        job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
        wait_until(lambda: client.get(f"/v1/rollouts/{job_id}").json()["buffered"] == 1, timeout=30,
                   message="the first group is buffered")  # fmt: skip
        time.sleep(0.3)  # several admission polls: the second group is still held back
        assert client.get(f"/v1/rollouts/{job_id}").json()["buffered"] == 1
        PolicyVersions(buf).publish(WeightsInfo(version=1, method="disk", path=model_dir_v1, published_at=time.time()),
                             set_version=True)  # fmt: skip
        assert wait_job(client, job_id)["buffered"] == 2
        groups = sorted(trainer_side(redis_url, run_id, 2), key=lambda g: g.submit_version)
    assert [(g.submit_version, g.min_version) for g in groups] == [(0, 0), (1, 1)]
    model = AutoModelForCausalLM.from_pretrained(model_dir_v1).eval()
    for s in groups[1].samples:
        assert s.versions.tolist() == [1] * 6
        want = logprobs_under(model, groups[1].prompt_tokens.tolist(), s.completion_ids.tolist())
        assert torch.allclose(torch.from_numpy(s.behavior_logprobs.astype(np.float32)), want, atol=1e-4)


def in_the_middle(engine, requests: int, tokens: int) -> bool:
    """All `requests` decode on the engine and each has sampled at least `tokens` tokens."""
    running = list(engine.engine.scheduler.running)  # a snapshot; the scheduler thread mutates it
    return len(running) == requests and min(len(r.output_ids) for r in running) >= tokens


@pytest.mark.parametrize("in_flight", [False, True], ids=["abort", "in_flight"])
def test_weight_update_mid_generation(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer, in_flight
):
    """Freeze the engine mid-sequence, publish version 1: the service aborts, updates, resubmits
    the remainders (or, `weight_update_in_flight`, pauses, updates and continues them with no
    abort, the engine reporting per-token versions); each token's logprob matches the weights
    of its version."""
    from transformers import AutoModelForCausalLM

    aborts_before = REGISTRY.get_sample_value("asyncrl_rollout_aborts_total") or 0.0
    with (
        own_engine_and_rollout(redis_url, run_id, reward, model_dir, tokenizer, batch_groups=8, max_staleness=1,
                               weight_update_in_flight=in_flight) as (engine, buf, running),
        httpx.Client(base_url=running.url, timeout=30) as client,
        httpx.Client(base_url=engine.url) as eng,
    ):  # fmt: skip
        body = {
            "prompts": [{"text": word(i) + ">"} for i in range(2)],
            "group_size": 2,
            "reward_spec": {"verifier": "reverse"},
            "sampling_params": {"max_new_tokens": 60, "ignore_eos": True, "temperature": 1.0},
        }
        job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
        wait_until(
            lambda: in_the_middle(engine, requests=4, tokens=8),
            timeout=30,
            interval=0.002,
            message="generation is under way",
        )
        assert eng.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        frozen = engine.engine.scheduler.stats["generated_tokens"]
        PolicyVersions(buf).publish(
            WeightsInfo(version=1, method="disk", path=model_dir_v1, published_at=time.time())
        )
        progress = wait_job(client, job_id)
        assert progress["buffered"] == 2
        assert eng.get("/get_model_info").json()["weight_version"] == "1"
        groups = trainer_side(redis_url, run_id, 2)

    models = {
        v: AutoModelForCausalLM.from_pretrained(d).eval() for v, d in ((0, model_dir), (1, model_dir_v1))
    }
    switched = 0
    for g in groups:
        assert g.submit_version == 0 and g.min_version == 0
        prompt = g.prompt_tokens.tolist()
        for s in g.samples:
            versions, tokens = s.versions.tolist(), s.completion_ids.tolist()
            assert len(tokens) == 60 and s.finish_reason.value == "length"
            k = versions.index(1) if 1 in versions else len(versions)
            assert versions == [0] * k + [1] * (60 - k)  # old tokens first, then new ones
            switched += 0 < k < 60
            for v, model in models.items():
                want = logprobs_under(model, prompt, tokens)
                mine = [t for t in range(60) if versions[t] == v]
                got = torch.from_numpy(s.behavior_logprobs[mine].astype(np.float32))
                assert torch.allclose(got, want[mine], atol=1e-4), (v, (got - want[mine]).abs().max())
    assert switched == 4, (
        f"only {switched} of 4 samples changed version mid-sequence (frozen at {frozen} tokens)"
    )
    aborts = (REGISTRY.get_sample_value("asyncrl_rollout_aborts_total") or 0.0) - aborts_before
    assert (aborts == 0) if in_flight else (aborts >= 4), aborts


# --------------------------------------------------------------------------------- replica death


def test_sigkill_of_a_replica_loses_no_group(
    redis_url, run_id, engine, reward, model_dir, tokenizer, tmp_path
):
    """Replica A claims all 12 groups but may admit only 4 (B = 4, η = 0). SIGKILL it; once the
    capacity grows, replica B recovers A's pending jobs and every group lands exactly once."""
    buf = Buffer(redis_url, run_id)
    admission = AdmissionControl(buf)
    admission.configure(batch_groups=4, max_staleness=0)
    port = free_port()
    s = settings(engine.url, reward.url, model_dir, run_id, replica="a")
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "rollout",
        "--port",
        str(port),
        "--redis-url",
        redis_url,
    ]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in s.items()]
    a = start_process(cmd, f"http://127.0.0.1:{port}", "/healthz", log_path=tmp_path / "replica_a.log")
    try:
        with httpx.Client(base_url=a.url, timeout=30) as client:
            body = {
                "prompts": [{"text": word(i) + ">"} for i in range(12)],
                "group_size": 2,
                "reward_spec": {"verifier": "reverse"},
            }
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            wait_until(
                lambda: (
                    client.get(f"/v1/rollouts/{job_id}").json()["buffered"] == 4
                    and buffer_stats(buf)["pending"]["jobs"] == 8
                ),
                timeout=30,
                message="4 groups are buffered and 8 jobs are claimed",
            )
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(timeout=10)
    finally:
        if a.proc.poll() is None:
            a.proc.kill()
    admission.configure(batch_groups=12, max_staleness=0)  # the trainer moved on: room for all 12
    b = serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **{**s, "replica": "b"})
    try:
        with httpx.Client(base_url=b.url, timeout=30) as client:
            progress = wait_job(client, job_id, timeout_s=30)
    finally:
        b.stop()
    assert (progress["buffered"], progress["failed"], progress["cancelled"]) == (12, 0, 0)
    stats = buffer_stats(buf)
    assert stats["depth"]["groups"] == 12 and stats["pending"]["jobs"] == 0
    assert stats["counters"].get("duplicates", 0) == 0 and stats["counters"]["put"] == 12
    groups = trainer_side(redis_url, run_id, 12)
    assert sorted(g.group_id for g in groups) == [f"{job_id}-{i:06d}" for i in range(12)]


# --------------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_a_clear_message(rollout, redis_url, run_id):
    ok = {"prompts": [{"text": "abcd>"}], "reward_spec": {"verifier": "reverse"}}
    cases = [
        ("malformed json", b'{"prompts": [', 400, "JSON"),
        ("wrong type", {**ok, "group_size": "four"}, 422, "group_size"),
        ("no prompts", {**ok, "prompts": []}, 422, "prompts"),
        ("empty text", {**ok, "prompts": [{"text": "  "}]}, 422, "empty prompt"),
        ("empty ids", {**ok, "prompts": [{"input_ids": []}]}, 422, "empty input_ids"),
        ("two inputs", {**ok, "prompts": [{"text": "a", "input_ids": [1]}]}, 422, "exactly one"),
        ("too long", {**ok, "prompts": [{"text": "ab" * CONTEXT}]}, 400, "context length"),
        ("negative temperature", {**ok, "sampling_params": {"temperature": -0.5}}, 422, "temperature"),
        ("over the cap", {**ok, "sampling_params": {"max_new_tokens": CAP + 1}}, 400, f"cap {CAP}"),
        ("unknown verifier", {**ok, "reward_spec": {"verifier": "astrology"}}, 400, "astrology"),
        ("no reward spec", {"prompts": [{"text": "abcd>"}]}, 422, "reward_spec"),
        ("out of vocabulary", {**ok, "prompts": [{"input_ids": [1, 10**6]}]}, 400, "vocabulary"),
        ("n > 1", {**ok, "sampling_params": {"n": 2}}, 422, "group_size"),
    ]
    for name, body, status, needle in cases:
        if isinstance(body, bytes):
            resp = rollout.post("/v1/rollouts", content=body, headers={"content-type": "application/json"})
        else:
            resp = rollout.post("/v1/rollouts", json=body)
        assert resp.status_code == status, (name, resp.text)
        message = resp.json().get("message") or resp.json()["detail"]
        assert needle.lower() in str(message).lower(), (name, message)
    assert buffer_stats(Buffer(redis_url, run_id))["depth"]["jobs"] == 0  # nothing was queued
    assert rollout.get("/v1/rollouts/jnope").status_code == 404
    assert rollout.delete("/v1/rollouts/jnope").status_code == 404


def test_idempotency_key_gives_one_job(rollout, redis_url, run_id):
    body = {
        "prompts": [{"text": word(i) + ">"} for i in range(3)],
        "group_size": 2,
        "reward_spec": {"verifier": "reverse"},
        "idempotency_key": "batch-7",
    }
    first = rollout.post("/v1/rollouts", json=body)
    second = rollout.post("/v1/rollouts", json=body)
    assert first.status_code == second.status_code == 202
    assert first.json()["job_id"] == second.json()["job_id"]
    assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
    conflict = rollout.post("/v1/rollouts", json={**body, "group_size": 3})
    assert conflict.status_code == 409 and "batch-7" in conflict.json()["detail"]
    progress = wait_job(rollout, first.json()["job_id"])
    assert progress["buffered"] == 3
    third = rollout.post("/v1/rollouts", json=body)  # after completion: still the same job, nothing new
    assert third.json() == {**first.json(), "duplicate": True}
    time.sleep(0.3)  # time is the subject: nothing new turns up in this while
    assert buffer_stats(Buffer(redis_url, run_id))["depth"]["groups"] == 3


def test_delete_cancels_pending_groups(redis_url, run_id, engine, reward, model_dir, tokenizer):
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(
        batch_groups=1, max_staleness=0
    )  # one group fits; the rest wait for admission
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {
                "prompts": [{"text": word(i) + ">"} for i in range(6)],
                "group_size": 2,
                "reward_spec": {"verifier": "reverse"},
            }
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            wait_job(client, job_id, until=("running",))
            wait_until(
                lambda: client.get(f"/v1/rollouts/{job_id}").json()["buffered"] >= 1,
                timeout=20,
                message="one group is buffered",
            )
            wait_until(
                lambda: buffer_stats(buf)["pending"]["jobs"] == 5,
                timeout=20,
                message="the other five are claimed and waiting for admission",
            )
            resp = client.delete(f"/v1/rollouts/{job_id}")
            assert resp.status_code == 200 and resp.json()["cancel_requested"] is True
            progress = wait_job(client, job_id, timeout_s=20)
    finally:
        running.stop()
    assert progress["state"] == "cancelled"
    assert (progress["buffered"], progress["cancelled"], progress["queued"]) == (1, 5, 0)
    admission = AdmissionControl(buf).snapshot()
    assert (admission["accepted"], admission["running"]) == (1, 0)  # the slots were given back
    assert buffer_stats(buf)["depth"]["groups"] == 1 and buffer_stats(buf)["pending"]["jobs"] == 0


# --------------------------------------------------------------------------------- broken engines


def serve_app(app, what: str) -> tuple[str, object]:
    """`app` on a free loopback port in a thread: (its URL, the uvicorn server, to stop)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: server.started, interval=0.01, message=what)
    return f"http://127.0.0.1:{port}", server


def garbage_engine() -> tuple[str, object]:
    """A real HTTP server that is healthy but answers /generate with a body that is not SGLang's."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/generate")
    def generate() -> dict:
        return {"text": 42, "meta_info": "nope"}

    @app.get("/health")
    def health() -> dict:
        return {}

    return serve_app(app, "the garbage engine started")


def test_down_and_garbage_engines_are_marked_unhealthy_and_groups_requeued(
    redis_url, run_id, engine, reward, model_dir, tokenizer
):
    from prometheus_client import REGISTRY

    def metric(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    garbage_url, garbage = garbage_engine()
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    urls = f"{dead_url},{garbage_url},{engine.url}"
    requeued0 = metric("asyncrl_rollout_groups_requeued_total", reason="engine")
    running = serve_in_thread(
        redis_url,
        loaded_tokenizer=tokenizer,
        **settings(
            urls,
            reward.url,
            model_dir,
            run_id,
            engine_retries=1,
            engine_unhealthy_after=2,
            engine_probe_s=60,
            requeue_backoff_max_s=0.2,
        ),
    )
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {
                "prompts": [{"text": word(i) + ">"} for i in range(6)],
                "group_size": 2,
                "reward_spec": {"verifier": "reverse"},
            }
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            progress = wait_job(client, job_id, timeout_s=30)
            assert (progress["buffered"], progress["failed"]) == (6, 0)
            assert "asyncrl_rollout_engine_healthy" in client.get("/metrics").text
    finally:
        running.stop()
        garbage.should_exit = True
    assert metric("asyncrl_rollout_engine_healthy", engine="0") == 0
    assert metric("asyncrl_rollout_engine_healthy", engine="1") == 0
    assert metric("asyncrl_rollout_engine_healthy", engine="2") == 1
    assert metric("asyncrl_rollout_groups_requeued_total", reason="engine") - requeued0 >= 2
    assert len(trainer_side(redis_url, run_id, 6)) == 6


PARTIAL = [5, 6, 7]  # the tokens the failing engine answers before it fails
PARTIAL_LOGPROBS = [-1.25, -2.5, -0.75]


def engine_that_fails_after_one_segment() -> tuple[str, object]:
    """A real HTTP server with SGLang's `/generate` shape: its first answer gives every input
    PARTIAL, aborted (as a weight update aborts requests); every later call answers 500, as an
    engine that broke (fault injection, not a stand-in)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), []

    @app.post("/generate")
    def generate(body: dict):
        calls.append(body)
        if len(calls) > 1:
            return JSONResponse({"error": {"message": "engine broke"}}, status_code=500)
        meta = {"finish_reason": {"type": "abort"}, "prompt_tokens": len(body["input_ids"][0]),
                "completion_tokens": len(PARTIAL), "weight_version": "0",
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(PARTIAL_LOGPROBS, PARTIAL)]}  # fmt: skip
        return [
            {"text": "", "output_ids": PARTIAL, "meta_info": {**meta, "id": f"{body['rid']}_{i}"}}
            for i in range(len(body["input_ids"]))
        ]

    @app.get("/health")
    def health() -> dict:
        return {}

    return serve_app(app, "the failing engine started")


def test_a_group_whose_engine_fails_goes_on_elsewhere_from_its_last_segment(
    redis_url, run_id, engine, reward, model_dir, tokenizer
):
    """The first engine answers one segment (aborted, budget left) and then fails: the group
    goes on on the other engine from prompt + that segment. Each sample keeps the segment's
    tokens and logprobs exactly, and the rest continues them (its logprobs are the model's given
    prompt + segment)."""
    from transformers import AutoModelForCausalLM

    def metric(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    failing_url, failing = engine_that_fails_after_one_segment()
    resumed0 = metric("asyncrl_rollout_failover_resumes_total")
    requeued0 = metric("asyncrl_rollout_groups_requeued_total", reason="engine")
    # the first engine picked is the first one listed; one failure marks it unhealthy
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **settings(f"{failing_url},{engine.url}", reward.url, model_dir, run_id, engine_retries=1,
                                         engine_unhealthy_after=1, engine_probe_s=60, requeue_backoff_max_s=0.2))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {"prompts": [{"text": "abcd>"}], "group_size": 2, "reward_spec": {"verifier": "reverse"},
                    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}  # fmt: skip
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            assert wait_job(client, job_id, timeout_s=30)["buffered"] == 1
    finally:
        running.stop()
        failing.should_exit = True
    assert metric("asyncrl_rollout_failover_resumes_total") - resumed0 == 2
    assert metric("asyncrl_rollout_groups_requeued_total", reason="engine") - requeued0 == 1
    (group,) = trainer_side(redis_url, run_id, 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = group.prompt_tokens.tolist()
    for s in group.samples:
        tokens = s.completion_ids.tolist()
        assert tokens[:3] == PARTIAL and len(tokens) == 8 and s.versions.tolist() == [0] * 8
        assert s.behavior_logprobs[:3].tolist() == PARTIAL_LOGPROBS
        want = logprobs_under(model, prompt + PARTIAL, tokens[3:])
        assert torch.allclose(torch.from_numpy(s.behavior_logprobs[3:].astype(np.float32)), want, atol=1e-4)


# --------------------------------------------------------------------------------- submit CLI


def test_submit_cli_posts_a_jsonl_dataset(rollout, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(f'{{"text": "{word(i)}>", "reward_spec": {{"verifier": "reverse"}}}}' for i in range(5))
    )
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "submit",
        str(data),
        "--url",
        str(rollout.base_url),
        "--group-size",
        "2",
        "--batch",
        "3",
        "--idempotency-key",
        "ds",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    jobs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [j["groups"] for j in jobs] == [3, 2]
    again = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=60)
    assert [json.loads(line)["duplicate"] for line in again.stdout.splitlines()] == [True, True]
    for j in jobs:
        assert wait_job(rollout, j["job_id"])["buffered"] == j["groups"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "typo"}\n')
    refused = subprocess.run(
        [*cmd[:4], str(bad), *cmd[5:]], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 1 and "unknown columns ['txt']" in refused.stderr


# --------------------------------------------------------------------------------- reward failures


def faulty_reward_service(calls: list | None = None) -> tuple[str, object]:
    """A real HTTP server with the reward API that fails on purpose: a batch whose spec target is
    "slow" never answers in time, "boom" gets HTTP 500 (fault injection, not a stand-in). Each
    `POST /v1/rewards` body is appended to `calls`."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/v1/verifiers")
    def verifiers() -> dict:
        return {
            "verifiers": [
                {"name": "reverse", "description": "", "spec_schema": {}, "concurrency": 1, "timeout_s": 1.0}
            ]
        }

    @app.post("/v1/rewards")
    async def rewards(body: dict):
        if calls is not None:
            calls.append(body)
        if body["items"][0]["spec"]["target"] == "slow":
            await asyncio.sleep(5)  # time is the subject: longer than the rollout's 0.5 s reward timeout
        return JSONResponse({"error": "verifier crashed"}, status_code=500)

    return serve_app(app, "the faulty reward service started")


def test_reward_timeouts_and_errors_become_statuses_not_zeros(
    redis_url, run_id, engine, model_dir, tokenizer
):
    from prometheus_client import REGISTRY

    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    url, server = faulty_reward_service()
    before = {
        s: REGISTRY.get_sample_value("asyncrl_rollout_reward_results_total", {"status": s}) or 0
        for s in ("timeout", "error")
    }
    running = serve_in_thread(
        redis_url,
        loaded_tokenizer=tokenizer,
        **settings(engine.url, url, model_dir, run_id, reward_timeout_s=0.5, reward_retries=1),
    )
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {
                "prompts": [
                    {"text": "ab>", "reward_spec": {"verifier": "reverse", "target": t}}
                    for t in ("slow", "boom")
                ],
                "group_size": 2,
            }
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            assert wait_job(client, job_id, timeout_s=30)["buffered"] == 2
    finally:
        running.stop()
        server.should_exit = True
    groups = {g.reward_spec["target"]: g for g in trainer_side(redis_url, run_id, 2)}
    for target, status in (("slow", RewardStatus.timeout), ("boom", RewardStatus.error)):
        for s in groups[target].samples:
            assert (s.reward_status, s.reward) == (status, None)
            assert s.reward_details["error"]
        after = REGISTRY.get_sample_value("asyncrl_rollout_reward_results_total", {"status": status.value})
        assert after - before[status.value] == 2


# --------------------------------------------------------------------------------- local verifiers


def test_local_verifiers_score_in_the_rollout_without_the_reward_service(
    redis_url, run_id, engine, model_dir, tokenizer
):
    """`local_verifiers = "reverse"`: reverse items never reach the reward service (here one
    that fails every batch) and are scored by the verifier's own rule in the rollout process."""
    from prometheus_client import REGISTRY

    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    calls: list = []
    url, server = faulty_reward_service(calls)
    local_before = REGISTRY.get_sample_value("asyncrl_rollout_reward_calls_total", {"result": "local"}) or 0
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **settings(engine.url, url, model_dir, run_id, local_verifiers="reverse"))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {"prompts": [{"text": f"{w}>", "reward_spec": {"verifier": "reverse", "target": w[::-1]}}
                                for w in ("slow", "boom", "abc")], "group_size": 3}  # fmt: skip
            job_id = client.post("/v1/rollouts", json=body).json()["job_id"]
            assert wait_job(client, job_id, timeout_s=30)["buffered"] == 3
    finally:
        running.stop()
        server.should_exit = True
    assert calls == []
    groups = trainer_side(redis_url, run_id, 3)
    assert len(groups) == 3
    for g in groups:
        for s in g.samples:
            assert s.reward_status is RewardStatus.scored
            assert s.reward == pytest.approx(reverse_reward(g.reward_spec["target"], s.text))
            assert s.reward_details["target_len"] == len(g.reward_spec["target"])
    local_after = REGISTRY.get_sample_value("asyncrl_rollout_reward_calls_total", {"result": "local"})
    assert 1 <= local_after - local_before <= 3  # one per group, or fewer when a caller merged


def test_local_and_remote_items_of_one_batch_keep_their_order_and_verdicts(reward):
    """A batch mixing a local verifier (reverse) and a remote one (arith): each item's result is
    the one the reward service gives the same item, in the caller's order; a spec the local
    scorer refuses makes the caller's local items `invalid_input`, never a silent 0."""
    import asyncio

    from asyncrl.proto.rewards import RewardItem, RewardResult, RewardSpec
    from asyncrl.services.rollout.clients.rewards import RewardClient

    def item(i: int, spec: dict, completion: str) -> RewardItem:
        return RewardItem(
            id=f"x{i}", prompt="abc>", completion=completion, spec=RewardSpec.model_validate(spec)
        )

    specs = [({"verifier": "reverse", "target": "cba"}, "cb"), ({"verifier": "arith", "answer": "12"}, " 12"),
             ({"verifier": "reverse"}, "cbz"), ({"verifier": "arith", "answer": "7", "format_credit": 0.2}, "8"),
             ({"verifier": "reverse", "target": "cba"}, "cba")]  # fmt: skip
    items = [item(i, spec, c) for i, (spec, c) in enumerate(specs)]

    async def run():
        kw = {"timeout_s": 10, "concurrency": 2, "retries": 0, "verifiers_ttl_s": 60}
        remote, mixed = (
            RewardClient(reward.url, **kw),
            RewardClient(reward.url, local_verifiers=["reverse"], **kw),
        )
        try:
            expected, got = await remote.score(items), await mixed.score(items)
            listed = await mixed.verifiers()
            bad = await mixed.score([item(9, {"verifier": "reverse", "target": ""}, "x"), items[1]])
        finally:
            await remote.aclose()
            await mixed.aclose()
        return expected, got, listed, bad

    expected, got, listed, bad = asyncio.run(run())
    # The service's results keep their ids; a local item's verdict is its position's.
    assert [r.id for r in got if isinstance(r, RewardResult)] == ["x1", "x3"]
    assert [(r.status, r.reward) for r in got] == [(r.status, r.reward) for r in expected]
    assert [r.reward for r in got] == pytest.approx([2 / 3, 1.0, 2 / 3, 0.2, 1.0])

    def uncached(r):  # (the service answers an item it has seen from its cache, and says so)
        return {k: v for k, v in r.details.items() if k != "cached"}

    assert [uncached(r) for r in got] == [uncached(r) for r in expected]
    assert [r.details.get("cached", False) for r in got] == [False, True, False, True, False]  # arith: remote
    assert {"reverse", "arith", "math"} <= set(listed)
    assert (bad[0].status, bad[0].reward) == (RewardStatus.invalid_input, None) and "target" in bad[
        0
    ].details["error"]
    assert (bad[1].status, bad[1].reward) == (RewardStatus.scored, 1.0)


def test_only_inline_verifiers_can_be_local():
    from pydantic import ValidationError

    from asyncrl.services.rollout.config import RolloutSettings

    base = {"run": "r", "tokenizer": "/nonexistent"}
    assert RolloutSettings(**base, local_verifiers=["reverse", "arith", "reverse"]).local_verifier_list == [
        "reverse", "arith"]  # fmt: skip
    for name in ("math", "nope"):
        with pytest.raises(
            ValidationError, match=f"'{name}' cannot be scored locally: only inline verifiers can"
        ):
            RolloutSettings(**base, local_verifiers=name)
