"""The `nemo_gym` verifier through the real reward service (uvicorn on loopback) against a
stand-in NeMo Gym resources server.

NeMo Gym cannot be installed here (it needs Python >= 3.12), so the resources server below is a
STAND-IN, written from NeMo Gym's source (github.com/NVIDIA-NeMo/Gym at commit
07d6b0d07b22fcf530b4c211dae2ee23100428e4). What it follows, file by file:

* nemo_gym/base_resources_server.py: `SimpleResourcesServer.setup_webserver` serves
  `POST /seed_session` (`BaseSeedSessionRequest` → `BaseSeedSessionResponse`, both empty in the
  base; a server subclasses them) and `POST /verify` (`BaseVerifyRequest`:
  `responses_create_params` + `response`, a `NeMoGymResponse`; `BaseVerifyResponse`: the request
  echoed plus `reward: float`; `BaseMultiRewardVerifyResponse` adds
  `reward_components: dict[str, float]`). There is no close route in the base server.
* nemo_gym/server_utils.py: `SimpleServer.setup_session_middleware`: Starlette's
  `SessionMiddleware` with the cookie named `f"{ClassName}___{config.name}"`, and a middleware
  that puts a uuid4 `session_id` (`SESSION_ID_KEY`) into every request's session, so each
  answer sets the cookie. The stand-in sets the same cookie name with an unsigned opaque id
  (NeMo Gym signs it with itsdangerous, not installed here; a client treats it as opaque).
* resources_servers/example_session_state_mgmt/app.py: state per session id, seeded by
  `/seed_session` from the row's own fields (`initial_count`), read by `/verify`.
* resources_servers/newton_bench/app.py and math_with_code/app.py: `POST /end_session`, the
  route that releases a session (others name it `/close`): the verifier's `close_path`.
* nemo_gym/judge.py: `judge_failsafe`: a failed judge call answers 200 with `reward: 0.0` and
  `_ng_failure_class: "judge_failed"` (`_ng_failure_judge_error`: the error).
* `mask_sample` is set by NeMo Gym's agents and token-id capture (responses_api_agents/
  osworld_agent/app.py, nemo_gym/token_id_capture/consumer.py) and honoured by NeMo RL
  (`should_mask_flagged_samples`); `failure_reason` is a per-server field (resources_servers/
  bird_sql/app.py). `failure_kind` appears nowhere in NeMo Gym at that commit: the stand-in
  sends it next to `mask_sample` as the issue describes, and the verifier reads it if present.
* responses_api_agents/simple_agent/app.py: the agent POSTs the whole row to `/seed_session`,
  then the row plus `response` to `/verify`, with the cookies seed_session set.

The stand-in validates `response` with the real `openai` package's `Response` model (what
`NeMoGymResponse` extends) and scores deterministically by the row's `case`.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from waiting import wait_until

COOKIE = "StandInMathServer___math"  # f"{ClassName}___{config.name}", as NeMo Gym names it
MAX_RETRIES = 2


def output_text(response) -> str:
    return "".join(
        part.text
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )


def stand_in_resources_server() -> FastAPI:
    """A resources server in NeMo Gym's shapes (module docstring), scoring by the row's `case`."""
    from openai.types.responses import Response

    app = FastAPI()
    sessions: dict[str, dict] = {}
    calls: Counter = Counter()

    @app.middleware("http")
    async def session_cookie(request: Request, call_next):
        request.state.session_id = request.cookies.get(COOKIE) or str(uuid.uuid4())
        response = await call_next(request)
        response.set_cookie(COOKIE, request.state.session_id, httponly=True)  # every answer sets it
        return response

    @app.post("/seed_session")
    async def seed_session(request: Request):
        body = await request.json()
        assert "input" in body["responses_create_params"], body
        calls["seed_session", body.get("case")] += 1
        sessions[request.state.session_id] = {"expected": body.get("expected_answer"), "verified": 0}
        return {}

    @app.post("/verify")
    async def verify(request: Request):
        body = await request.json()
        case = body.get("case")
        calls["verify", case] += 1
        state = sessions.get(request.state.session_id)
        if state is None:  # the session check: seed_session first, with this cookie
            calls["unseeded"] += 1
            return JSONResponse({"detail": "session not seeded"}, status_code=400)
        if "input" not in body["responses_create_params"]:
            return JSONResponse({"detail": "responses_create_params.input missing"}, status_code=422)
        response = Response.model_validate(body["response"])  # a 500 if it is not a Response
        state["verified"] += 1
        if case == "crash":
            return JSONResponse({"detail": "verifier crashed"}, status_code=500)
        if case == "flaky" and calls["verify", "flaky"] == 1:
            return JSONResponse({"detail": "busy"}, status_code=503)
        if case == "judge":
            return {
                **body,
                "reward": 0.0,
                "_ng_failure_class": "judge_failed",
                "_ng_failure_judge_error": "judge timed out",
            }
        if case == "mask":
            return {
                **body,
                "reward": 0.0,
                "mask_sample": True,
                "failure_kind": "sandbox",
                "failure_reason": "sandbox did not start",
            }
        if case == "weird_mask":
            return {**body, "reward": 0.0, "mask_sample": True, "failure_kind": "gpu on fire"}
        if case == "no_reward":
            return {**body, "reward": None}
        if case == "tool":
            calls_ = [item for item in response.output if item.type == "function_call"]
            ok = len(calls_) == 1 and calls_[0].name == "lookup"
            ok = ok and json.loads(calls_[0].arguments) == {"key": state["expected"]}
            return {**body, "reward": float(ok), "reward_components": {"tool": float(ok)}}
        correct = float(str(state["expected"]) in output_text(response))
        return {
            **body,
            "reward": correct,
            "reward_components": {"correct": correct, "format": 1.0},
            "failure_reason": None if correct else "wrong_answer",
        }

    @app.post("/end_session")
    async def end_session(request: Request):
        calls["end_session"] += 1
        sessions.pop(request.state.session_id, None)
        return {}

    app.state.calls, app.state.sessions = calls, sessions
    return app


def serve(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="the server started")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(scope="module")
def gym():
    app = stand_in_resources_server()
    url, server, thread = serve(app)
    yield url, app
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def service(gym):
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings

    settings = RewardSettings(
        code_enabled=False,
        math_workers=1,
        nemo_gym={"math": {"url": gym[0], "close_path": "/end_session"}},
        nemo_gym_max_retries=MAX_RETRIES,
        nemo_gym_backoff_s=0.01,
        nemo_gym_request_timeout_s=10.0,
    )
    url, server, thread = serve(build_app(settings))
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client
    server.should_exit = True
    thread.join(timeout=30)


def item(id_, completion, prompt="What is 6*7?", **task):
    return {
        "id": id_,
        "prompt": prompt,
        "completion": completion,
        "spec": {"verifier": "nemo_gym", "server": "math", "task": task},
    }


def score(client, *items) -> dict[str, dict]:
    reply = client.post("/v1/rewards", json={"items": list(items)})
    assert reply.status_code == 200, reply.text
    return {r["id"]: r for r in reply.json()["results"]}


def metric(client, name: str, **labels) -> float:
    """The value of the sample `name{labels}` in /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_rewards_and_components_come_from_verify(service, gym):
    calls = gym[1].state.calls
    seeded, closed = calls["seed_session", "ok"], calls["end_session"]
    before = metric(service, "asyncrl_reward_nemo_gym_verdicts_total", server="math", outcome="scored")
    results = score(
        service,
        item("right", "Let me think. The answer is 42.", case="ok", expected_answer=42),
        item("wrong", "The answer is 41.", case="ok", expected_answer=43),
        item(
            "tool",
            'I will look.<tool_call>{"name": "lookup", "arguments": {"key": "k7"}}</tool_call>',
            case="tool",
            expected_answer="k7",
        ),  # fmt: skip
    )
    assert results["right"]["status"] == "scored" and results["right"]["reward"] == 1.0
    assert results["right"]["details"]["reward_components"] == {"correct": 1.0, "format": 1.0}
    assert results["wrong"]["status"] == "scored" and results["wrong"]["reward"] == 0.0
    assert results["wrong"]["details"]["failure_reason"] == "wrong_answer"
    assert results["tool"]["status"] == "scored" and results["tool"]["reward"] == 1.0
    assert results["tool"]["details"]["reward_components"] == {"tool": 1.0}
    # one session each: seeded, verified, closed
    assert calls["seed_session", "ok"] == seeded + 2 and calls["verify", "tool"] == 1
    assert calls["end_session"] == closed + 3
    assert calls["unseeded"] == 0
    assert (
        metric(service, "asyncrl_reward_nemo_gym_verdicts_total", server="math", outcome="scored")
        == before + 3
    )


def test_concurrent_samples_keep_their_own_sessions(service, gym):
    """Each sample's session holds its own expected answer: a cookie shared or lost between
    samples would score a right answer against another's state (or hit the unseeded check)."""
    calls, sessions = gym[1].state.calls, gym[1].state.sessions
    closes = calls["end_session"]
    items = [item(f"s{i}", f"answer: {1000 + i}", case="ok", expected_answer=1000 + i) for i in range(12)]
    items += [item(f"x{i}", f"answer: {2000 + i}", case="ok", expected_answer=3000 + i) for i in range(4)]
    results = score(service, *items)
    assert [results[f"s{i}"]["reward"] for i in range(12)] == [1.0] * 12
    assert [results[f"x{i}"]["reward"] for i in range(4)] == [0.0] * 4
    assert calls["unseeded"] == 0
    assert calls["end_session"] == closes + 16
    assert sessions == {}  # every session closed


def test_mask_sample_is_masked_never_a_zero(service, gym):
    masked = {"server": "math", "outcome": "masked"}
    before = metric(service, "asyncrl_reward_nemo_gym_verdicts_total", **masked)
    sandbox = metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="sandbox")
    other = metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="other")
    results = score(
        service,
        item("m1", "The answer is 42.", case="mask", expected_answer=42),
        item("m2", "The answer is 42!", case="weird_mask", expected_answer=42),
    )
    m1, m2 = results["m1"], results["m2"]
    assert (m1["status"], m1["reward"], m1["details"]["reason"]) == ("error", None, "masked")
    assert m1["details"]["failure_kind"] == "sandbox"
    assert m1["details"]["failure_reason"] == "sandbox did not start"
    assert m1["details"]["reported_reward"] == 0.0
    assert (m2["status"], m2["reward"], m2["details"]["failure_kind"]) == ("error", None, "other")
    assert m2["details"]["reported_kind"] == "gpu on fire"
    assert metric(service, "asyncrl_reward_nemo_gym_verdicts_total", **masked) == before + 2
    assert (
        metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="sandbox")
        == sandbox + 1
    )
    assert metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="other") == other + 1
    assert (
        metric(service, "asyncrl_reward_verifier_failures_total", verifier="nemo_gym", reason="masked") >= 2
    )


def test_judge_failure_is_an_error_not_a_zero(service):
    result = score(service, item("j", "The answer is 42.", case="judge", expected_answer=42))["j"]
    assert (result["status"], result["reward"], result["details"]["reason"]) == (
        "error",
        None,
        "judge_failed",
    )
    assert result["details"]["failure_kind"] == "judge_failed"
    assert result["details"]["error"] == "judge timed out"


def test_a_500_is_retried_then_a_counted_failure(service, gym):
    calls = gym[1].state.calls
    unavailable = metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="unavailable")
    result = score(service, item("c", "The answer is 42.", case="crash", expected_answer=42))["c"]
    assert (result["status"], result["reward"], result["details"]["reason"]) == (
        "error",
        None,
        "nemo_gym_unavailable",
    )
    assert result["details"]["attempts"] == MAX_RETRIES + 1
    assert "HTTP 500" in result["details"]["last_error"]
    assert calls["verify", "crash"] == MAX_RETRIES + 1  # each attempt a fresh session
    assert calls["seed_session", "crash"] == MAX_RETRIES + 1
    assert (
        metric(service, "asyncrl_reward_nemo_gym_failures_total", server="math", kind="unavailable")
        == unavailable + 1
    )
    assert (
        metric(
            service,
            "asyncrl_reward_nemo_gym_calls_total",
            server="math",
            route="verify",
            outcome="http_error",
        )
        >= 3
    )


def test_a_503_then_success_is_scored_on_the_second_attempt(service):
    result = score(service, item("f", "It is 42", case="flaky", expected_answer=42))["f"]
    assert (result["status"], result["reward"], result["details"]["attempts"]) == ("scored", 1.0, 2)


def test_an_answer_without_a_reward_is_an_error(service):
    result = score(service, item("n", "42", case="no_reward", expected_answer=42))["n"]
    assert (result["status"], result["reward"], result["details"]["reason"]) == (
        "error",
        None,
        "nemo_gym_bad_response",
    )
    assert "reward=None" in result["details"]["error"]


def test_responses_create_params_of_the_row_are_sent(service, gym):
    """A row's own `responses_create_params` goes to the server as given (no `input` → 422 here)."""
    spec = {
        "verifier": "nemo_gym",
        "server": "math",
        "task": {"case": "ok", "expected_answer": 9},
        "responses_create_params": {"input": "What is 3*3?", "model": "policy-7b", "temperature": 0.7},
    }
    result = score(service, {"id": "r", "prompt": "", "completion": "9", "spec": spec})["r"]
    assert (result["status"], result["reward"]) == ("scored", 1.0)


def test_specs_name_configured_servers_only(service):
    cases = {
        "unknown": {"server": "elsewhere"},
        "url": {"server": "http://169.254.169.254/"},
        "reserved": {"server": "math", "task": {"response": {}}},
        "no_input": {"server": "math", "responses_create_params": {"model": "m"}},
    }
    for name, args in cases.items():
        reply = service.post(
            "/v1/rewards",
            json={"items": [{"id": name, "completion": "x", "spec": {"verifier": "nemo_gym", **args}}]},
        )
        assert reply.status_code == 422, (name, reply.text)
    text = service.post(
        "/v1/rewards",
        json={
            "items": [{"id": "u", "completion": "x", "spec": {"verifier": "nemo_gym", "server": "elsewhere"}}]
        },
    ).text
    assert "'elsewhere' is not a configured NeMo Gym server (configured: math)" in text


def test_settings_read_servers_from_toml(tmp_path):
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.runtime.config import load_settings

    path = tmp_path / "reward.toml"
    path.write_text('[reward.nemo_gym.math]\nurl = "http://127.0.0.1:8123/"\nclose_path = "/end_session"\n')
    settings = load_settings(RewardSettings, ["--config", str(path)], prog="reward", section="reward")
    assert settings.nemo_gym["math"].url == "http://127.0.0.1:8123"
    assert settings.nemo_gym["math"].close_path == "/end_session"
    with pytest.raises(ValueError, match="http"):
        RewardSettings(nemo_gym={"math": {"url": "file:///etc/passwd"}})
    with pytest.raises(ValueError, match="names must match"):
        RewardSettings(nemo_gym={"Bad Name": {"url": "http://127.0.0.1:1"}})


def test_a_rollout_job_buffers_masked_samples_masked(service, gym, redis_url, run_id, tmp_path):
    """Through the rollout service (tiny random model on the reference engine, real Redis): a
    group the server masks reaches the buffer with no reward and is masked out of the trainer's
    rows; a scored group keeps the server's rewards."""
    import torch
    from engine_server import serve_in_thread as serve_engine
    from rollout_server import serve_in_thread as serve_rollout
    from rollout_server import wait_job

    from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
    from asyncrl.services.ops.tinymodel import build_tiny_model
    from asyncrl.trainer.batch import build_rows

    torch.set_num_threads(1)
    model = tmp_path / "model"
    build_tiny_model(model, seed=0, max_position_embeddings=128)
    engine = serve_engine(str(model), max_running_requests=8, max_new_tokens_cap=16, context_length=128)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    rollout = serve_rollout(
        redis_url,
        run=run_id,
        replica="r0",
        engine_urls=engine.url,
        reward_url=str(service.base_url),
        tokenizer=str(model),
        max_new_tokens_cap=16,
        default_max_new_tokens=8,
        claim_poll_s=0.05,
        admission_poll_s=0.05,
    )

    def spec(**task) -> dict:
        return {"verifier": "nemo_gym", "server": "math", "task": task}

    try:
        with httpx.Client(base_url=rollout.url, timeout=30) as client:
            body = {
                "prompts": [
                    {"text": "ab>", "reward_spec": spec(case="ok", expected_answer="a")},
                    {"text": "cd>", "reward_spec": spec(case="mask", expected_answer="c")},
                ],
                "group_size": 3,
            }
            reply = client.post("/v1/rollouts", json=body)
            assert reply.status_code in (200, 201, 202), reply.text
            assert wait_job(client, reply.json()["job_id"], timeout_s=120)["buffered"] == 2
    finally:
        rollout.stop()
        engine.stop()
    buf = Buffer(redis_url, run_id)
    groups = (
        Groups(buf, "test-trainer")
        .take(2, current_version=PolicyVersions(buf).version(), max_staleness=10**6, block_ms=2000)
        .groups
    )
    by_case = {g.reward_spec["task"]["case"]: g for g in groups}
    ok, masked = by_case["ok"].samples, by_case["mask"].samples
    assert [s.value for s in ok.reward_status] == ["scored"] * 3
    assert list(ok.reward) == [float("a" in text) for text in ok.text]  # the stand-in's rule
    assert [s.value for s in masked.reward_status] == ["error"] * 3
    assert list(masked.reward) == [None] * 3
    assert [d["reason"] for d in masked.reward_details] == ["masked"] * 3
    assert [d["failure_kind"] for d in masked.reward_details] == ["sandbox"] * 3
    batch = build_rows([by_case["ok"], by_case["mask"]], "grpo")
    assert batch.masked == {"error": 3}
    assert [row.valid for row in batch.rows] == [True] * 3 + [False] * 3
