"""The reward service over real HTTP (uvicorn on loopback): batches, bad inputs, timeouts,
cache, metrics, and judge round trips against a canned OpenAI-shaped server and against the
reference engine (`asyncrl engine`, a subprocess on a tiny random model)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from waiting import wait_until

REPO = Path(__file__).resolve().parents[3]


def serve(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "the server thread died"
        return server.started

    wait_until(started, message="the server started")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def canned_judge() -> FastAPI:
    """OpenAI-shaped judge whose behaviour is chosen by a `CASE:` tag in the rubric."""
    app, calls = FastAPI(), Counter()

    def reply(content: str):
        return {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ]
        }

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        text = body["messages"][-1]["content"]
        case = text.split("CASE:", 1)[1].split()[0]
        calls[case] += 1
        if case == "json":
            return reply('Reasoning...\n```json\n{"score": 8, "why": "good"}\n```')
        if case == "line":
            return reply("The response is partly right.\n**Score:** 3")
        if case == "flaky":
            if calls[case] <= 2:
                return JSONResponse({"error": "overloaded"}, status_code=503)
            return reply("Score: 10")
        if case == "garbage":
            return reply("I cannot decide, it depends on many things.")
        if case == "badrequest":
            return JSONResponse({"error": "bad model"}, status_code=400)
        if case == "slow":
            import asyncio

            await asyncio.sleep(5)  # time is the subject: longer than the judge's 1 s request timeout
            return reply("Score: 5")
        return JSONResponse({"error": "unknown case"}, status_code=404)

    app.state.calls = calls
    return app


@pytest.fixture(scope="module")
def judge_url():
    app = canned_judge()
    url, server, thread = serve(app)
    yield url, app.state.calls
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def service(judge_url):
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings

    settings = RewardSettings(
        code_enabled=False,
        math_workers=1,
        math_timeout_s=2.0,
        judge_base_url=f"{judge_url[0]}/v1",
        judge_request_timeout_s=1.0,
        judge_max_retries=2,
        judge_backoff_s=0.05,
        max_body_bytes=1 << 20,
    )
    url, server, thread = serve(build_app(settings))
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client
    server.should_exit = True
    thread.join(timeout=30)


def post(client, *items) -> httpx.Response:
    return client.post("/v1/rewards", json={"items": list(items)})


def item(id_, completion, prompt="", **spec):
    return {"id": id_, "prompt": prompt, "completion": completion, "spec": spec}


def test_mixed_batch_scores_each_verifier(service):
    reply = post(
        service,
        item("m", r"thus \boxed{\frac{1}{2}}", verifier="math", answer="0.5"),
        item("m0", r"\boxed{3}", verifier="math", answer="4"),
        item("mbad", r"\boxed{3}", verifier="math", answer=r"\frac{"),
        item("r", "dcbx", prompt="abcd>", verifier="reverse"),
        item("a", "41", verifier="arith", answer="42", format_credit=0.25),
    )
    assert reply.status_code == 200, reply.text
    got = {r["id"]: (r["status"], r["reward"]) for r in reply.json()["results"]}
    assert got == {
        "m": ("scored", 1.0),
        "m0": ("scored", 0.0),
        "mbad": ("invalid_input", None),
        "r": ("scored", 0.75),
        "a": ("scored", 0.25),
    }


def test_bad_inputs_are_rejected_whole_with_a_message(service):
    unknown = post(service, item("ok", "x", verifier="reverse", target="x"), item("u", "x", verifier="nope"))
    assert unknown.status_code == 422
    assert unknown.json()["detail"][0]["id"] == "u" and "unknown or disabled verifier 'nope'" in unknown.text
    bad_spec = post(service, item("s", "x", verifier="math"))
    assert bad_spec.status_code == 422 and "math: answer: Field required" in bad_spec.text
    extra = post(service, item("e", "x", verifier="arith", answer="1", bonus=2))
    assert extra.status_code == 422 and "bonus" in extra.text
    dupes = post(
        service,
        item("d", "x", verifier="reverse", target="x"),
        item("d", "y", verifier="reverse", target="x"),
    )
    assert dupes.status_code == 422 and "unique" in dupes.text
    assert service.post("/v1/rewards", json={"items": []}).status_code == 422
    assert (
        service.post(
            "/v1/rewards", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 422
    )
    huge = service.post(
        "/v1/rewards", json={"items": [item("h", "x" * (2 << 20), verifier="reverse", target="x")]}
    )
    assert huge.status_code == 413 and "larger than" in huge.text
    chunked = service.post(
        "/v1/rewards", content=iter([b'{"items": [{"id": "c", "completion": "', b"x" * (2 << 20), b'"}]}'])
    )
    assert chunked.status_code == 413
    metrics = service.get("/metrics").text
    assert 'asyncrl_reward_requests_total{outcome="rejected"}' in metrics


def test_slow_item_times_out_without_holding_the_batch(service):
    started = time.monotonic()
    reply = post(
        service,
        item("hang", r"\boxed{9^{9^{9^{9}}}}", verifier="math", answer="1"),
        item("fast", "ab", verifier="reverse", target="ab"),
    )
    elapsed = time.monotonic() - started
    results = {r["id"]: r for r in reply.json()["results"]}
    assert (results["hang"]["status"], results["hang"]["details"]["reason"]) == ("timeout", "math_timeout")
    assert results["fast"]["reward"] == 1.0
    assert elapsed < 2.0 + 3.0  # math timeout + slack; never the hang's natural (unbounded) time
    after = post(service, item("next", r"\boxed{7}", verifier="math", answer="7")).json()["results"][0]
    assert (after["status"], after["reward"]) == ("scored", 1.0)  # the killed worker was replaced


def test_cache_answers_repeats_and_metrics_count_them(service):
    spec = {"verifier": "math", "answer": "12"}
    first = post(service, {"id": "c1", "completion": r"\boxed{12}", "spec": spec}).json()["results"][0]
    second = post(service, {"id": "c2", "completion": r"\boxed{12}", "spec": spec}).json()["results"][0]
    assert first["reward"] == second["reward"] == 1.0
    assert "cached" not in first["details"] and second["details"]["cached"] is True
    metrics = service.get("/metrics").text
    assert 'asyncrl_reward_cache_hits_total{verifier="math"}' in metrics
    assert 'asyncrl_reward_items_total{status="scored",verifier="math"}' in metrics
    assert "asyncrl_reward_verify_seconds_bucket" in metrics


def test_verifiers_endpoint_lists_schemas(service):
    listed = {v["name"]: v for v in service.get("/v1/verifiers").json()["verifiers"]}
    assert sorted(listed) == ["arith", "judge", "math", "reverse"]
    assert listed["math"]["spec_schema"]["required"] == ["answer"]
    assert "rubric" in listed["judge"]["spec_schema"]["properties"]
    assert service.get("/healthz").json() == {
        "status": "ok",
        "verifiers": dict.fromkeys(sorted(listed), "ok"),
    }


def test_judge_round_trips_against_canned_server(service, judge_url):
    calls = judge_url[1]
    reply = post(
        service,
        item("json", "answer", prompt="q", verifier="judge", rubric="CASE:json be fair"),
        item("line", "answer", prompt="q", verifier="judge", rubric="CASE:line", scale=[1, 5]),
        item("flaky", "answer", prompt="q", verifier="judge", rubric="CASE:flaky"),
        item("garbage", "answer", prompt="q", verifier="judge", rubric="CASE:garbage"),
        item("badrequest", "answer", prompt="q", verifier="judge", rubric="CASE:badrequest"),
        item("slow", "answer", prompt="q", verifier="judge", rubric="CASE:slow"),
    )
    results = {r["id"]: r for r in reply.json()["results"]}
    assert (results["json"]["status"], results["json"]["reward"]) == ("scored", 0.8)
    assert (results["line"]["status"], results["line"]["reward"]) == ("scored", 0.5)  # 3 on [1, 5]
    assert (results["flaky"]["reward"], results["flaky"]["details"]["attempts"]) == (1.0, 3)
    assert calls["flaky"] == 3
    assert (results["garbage"]["status"], results["garbage"]["details"]["reason"]) == (
        "error",
        "unparseable_score",
    )
    assert results["garbage"]["reward"] is None
    assert (results["badrequest"]["status"], results["badrequest"]["details"]["reason"]) == (
        "error",
        "judge_http_error",
    )
    assert calls["badrequest"] == 1  # a 400 is not retried
    assert (results["slow"]["status"], results["slow"]["details"]["reason"]) == ("error", "judge_unavailable")
    assert "ReadTimeout" in results["slow"]["details"]["last_error"] and calls["slow"] == 3
    bad_scale = post(service, item("s", "a", verifier="judge", rubric="r", scale=[5, 1]))
    assert bad_scale.status_code == 422 and "low < high" in bad_scale.text


def test_live_judge_round_trip_against_reference_engine(tmp_path):
    if not (REPO / "services" / "engine" / "main.py").exists():
        pytest.skip("reference engine not available")
    import asyncio

    from asyncrl.services.ops.tinymodel import build_tiny_model
    from asyncrl.services.reward.verifiers.judge import JudgeVerifier

    build_tiny_model(tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "engine",
        "--model",
        str(tmp_path / "model"),
        "--port",
        str(port),
    ]
    engine = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert engine.poll() is None, engine.stderr.read().decode()[-2000:]
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=120, interval=0.3, message="the engine is healthy")
        judge = JudgeVerifier(
            base_url=f"{base}/v1", model="tiny", api_key=None, concurrency=1, request_timeout_s=60,
            item_timeout_s=120, max_retries=0, backoff_s=0, max_tokens=16, temperature=1.0, max_chars=1000,
        )  # fmt: skip

        async def judge_once():
            await judge.start()
            try:
                return await judge.verify(judge.parse_spec({"rubric": "is it right?"}), "what is 2+2?", "4")
            finally:
                await judge.close()

        verdict = asyncio.run(judge_once())
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    # A random tiny model writes garbage: the round trip must have happened (a reply was
    # parsed out of a real OpenAI-shaped response), and the outcome is never a silent 0.
    if verdict.status.value == "error":
        assert verdict.details["reason"] == "unparseable_score" and isinstance(verdict.details["raw"], str)
    else:
        assert verdict.status.value == "scored" and 0.0 <= verdict.reward <= 1.0
