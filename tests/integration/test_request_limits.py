"""Request limits of the three services over real HTTP (uvicorn on loopback, in threads): the
reference engine on a tiny model, the rollout service on a real Redis (fixture), the reward
service with its toy verifiers. Oversize bodies get 413 (declared or streamed), a validation
error never echoes the input nor fails on odd unicode, the engine refuses what it cannot
serve (huge texts, huge batches, negative logprob_start_len) with a 4xx and keeps /health
answering while it handles a long text."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest
import torch
from engine_server import free_port
from engine_server import serve_in_thread as serve_engine

from asyncrl.services.engine.engine import MAX_CHARS_PER_TOKEN
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.runtime.serving import serve_app_in_thread

torch.set_num_threads(1)

CONTEXT = 32768  # long enough that a text under the length bound takes seconds to tokenize
ENGINE_MAX_BODY = 4 << 20
REWARD_MAX_BODY = 1 << 20
ROLLOUT_MAX_BODY = RolloutSettings.model_fields["max_body_bytes"].default
MAX_BATCH = 4
HEALTH_BUDGET_S = 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_engine(
        model_dir, max_running_requests=2, max_batch_size=MAX_BATCH, max_body_bytes=ENGINE_MAX_BODY
    )
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield client
    running.stop()


@pytest.fixture(scope="module")
def reward():
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.reward.verifiers.toy import ReverseVerifier

    settings = RewardSettings(code_enabled=False, max_body_bytes=REWARD_MAX_BODY)
    verifiers = {"reverse": ReverseVerifier(concurrency=8, timeout_s=2.0)}
    http = serve_app_in_thread(build_app(settings, verifiers), free_port(), "reward")
    with httpx.Client(base_url=http.url, timeout=60) as client:
        yield client
    http.stop()


@pytest.fixture(scope="module")
def rollout(redis_server, model_dir, reward):
    """The rollout service's HTTP API alone (no scheduler: nothing here is generated)."""
    from transformers import AutoTokenizer

    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.service import RolloutService

    settings = RolloutSettings(
        port=free_port(), redis_url=redis_server.url, run="limits", replica="r0", tokenizer=model_dir,
        engine_urls="http://127.0.0.1:9", reward_url=str(reward.base_url).rstrip("/"),
    )  # fmt: skip
    service = RolloutService(settings, redis_server.url, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    http = serve_app_in_thread(build_app(service, run_scheduler=False), settings.port, "rollout")
    with httpx.Client(base_url=http.url, timeout=60) as client:
        yield client
    http.stop()


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# fixture name: (path, its max_body_bytes, the counter of its refusals)
SERVICES = {
    "engine": ("/generate", ENGINE_MAX_BODY, 'asyncrl_engine_requests_rejected_total{reason="body_too_large"}'),
    "rollout": ("/v1/rollouts", ROLLOUT_MAX_BODY, 'asyncrl_rollout_requests_rejected_total{reason="body_too_large"}'),
    "reward": ("/v1/rewards", REWARD_MAX_BODY, 'asyncrl_reward_requests_total{outcome="rejected"}'),
}  # fmt: skip


@pytest.mark.parametrize("name", SERVICES)
def test_oversize_body_gets_413_declared_or_streamed(request, name):
    client = request.getfixturevalue(name)
    path, cap, counter = SERVICES[name]
    before = metric(client, counter)
    body = b'{"text": "' + b"a" * cap + b'"}'
    declared = client.post(path, content=body, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "larger than" in declared.json()["detail"], declared.text
    chunks = iter([b'{"text": "', *[b"a" * (1 << 20)] * (cap >> 20), b'"}'])  # no Content-Length
    streamed = client.post(path, content=chunks, headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "larger than" in streamed.json()["detail"], streamed.text
    assert metric(client, counter) == before + 2


BIG_BODY = 64 << 20  # a body a client sends in full before it reads the answer


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "streamed"])
@pytest.mark.parametrize("name", SERVICES)
def test_a_client_sending_a_64_mib_body_reads_the_413(request, name, chunked):
    """The standard library's client (http.client, under urllib and requests) writes the whole
    body before it reads: a server that answers and closes without reading the rest makes
    that write fail with a broken pipe, and the client never sees the 413."""
    client = request.getfixturevalue(name)
    path, cap, counter = SERVICES[name]
    before = metric(client, counter)
    body = b'{"text": "' + b"a" * BIG_BODY + b'"}'
    data = iter(body[at : at + (1 << 20)] for at in range(0, len(body), 1 << 20)) if chunked else body
    req = urllib.request.Request(
        f"{str(client.base_url).rstrip('/')}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["detail"] == f"request body larger than {cap} bytes"
    assert refused.value.headers["Connection"] == "close"
    assert metric(client, counter) == before + 1


def test_rollout_refuses_a_100_mb_body_before_reading_it(rollout):
    """Only the headers are sent: an answer proves the body was never waited for."""
    host, port = rollout.base_url.host, rollout.base_url.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 104857600\r\n\r\n{"
        )
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head


def test_reward_422_does_not_echo_the_input(reward):
    """FastAPI's own handler answered each error's `input`: here the whole 500 kB item."""
    item = {"id": "a", "completion": "x" * 500_000}  # no `spec`
    missing = reward.post("/v1/rewards", json={"items": [item]})
    assert missing.status_code == 422 and len(missing.content) < 2000, len(missing.content)
    assert "spec" in missing.json()["message"]
    many = reward.post(
        "/v1/rewards", json={"items": [{"id": str(i), "completion": "x"} for i in range(1000)]}
    )
    assert many.status_code == 422 and len(many.content) < 10_000, len(many.content)
    body = many.json()
    assert "more" in body["message"] and 0 < len(body["detail"]) < 1000


# A JSON `\ud800` escape is a lone surrogate, which UTF-8 cannot encode (FastAPI's own handler
# echoed it back and failed with a 500); a NUL goes into an unknown field's name, quoted in `loc`.
ODD = b'"\\ud800", "k\\u0000": 1'
ODD_BODIES = {
    "engine": ("/generate", b'{"text": ' + ODD + b"}"),
    "rollout": ("/v1/rollouts", b'{"prompts": [{"text": ' + ODD + b'}], "reward_spec": {"verifier": "reverse"}}'),
    "reward": ("/v1/rewards", b'{"items": [{"id": "a", "spec": {"verifier": "reverse"}, "completion": ' + ODD + b"}]}"),
}  # fmt: skip


@pytest.mark.parametrize("name", ODD_BODIES)
def test_lone_surrogates_and_nuls_get_a_4xx_not_a_500(request, name):
    client = request.getfixturevalue(name)
    path, body = ODD_BODIES[name]
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert "\\ud800" not in resp.text and "k\x00" in resp.json()["message"]  # no input, the key quoted


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/generate", b'{"text": "a\\ud800b"}', "text"),
    ("/generate", b'{"text": "hi", "rid": "\\udfff", "sampling_params": {"max_new_tokens": 1}}', "rid"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "content"),
    ("/v1/chat/completions", b'{"model": "\\ud800", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}',
     "model"),
])  # fmt: skip
def test_a_lone_surrogate_alone_is_a_422_not_a_500(engine, path, body, field):
    """Found by benchmarks/bad_inputs.py: with no other error in the body, a lone surrogate
    reached the tokenizer (TypeError) or the answer's encoder (UnicodeEncodeError)."""
    resp = engine.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert field in resp.json()["message"] and "lone UTF-16 surrogate" in resp.json()["message"]


def test_logprob_start_len_below_minus_one_is_400(engine):
    resp = engine.post(
        "/generate", json={"input_ids": [1, 5, 6], "return_logprob": True, "logprob_start_len": -5}
    )
    assert resp.status_code == 400 and "logprob_start_len" in resp.json()["error"]["message"], resp.text


def test_oversize_batch_is_400_with_a_message(engine):
    resp = engine.post("/generate", json={"input_ids": [[1, 5]] * (MAX_BATCH + 1)})
    assert resp.status_code == 400 and "max_batch_size" in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize(
    "chars,needle",
    [(CONTEXT * MAX_CHARS_PER_TOKEN + 1, "cannot fit"), (2_000_000, "does not fit")],
    ids=["refused before tokenizing", "tokenized in a thread"],
)
def test_health_answers_while_a_long_text_is_handled(engine, chars, needle):
    """A text over the length bound is refused untokenized; one under it is tokenized in a
    thread. Tokenized on the event loop instead, either froze /health for seconds."""
    result = {}
    text = ("abcd" * (chars // 4 + 1))[:chars]
    worker = threading.Thread(
        target=lambda: result.update(resp=engine.post("/generate", json={"text": text}))
    )
    worker.start()
    latencies = []
    with httpx.Client(base_url=engine.base_url, timeout=30) as probe:
        while not latencies or worker.is_alive():
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)  # time is the subject: /health is sampled every 20 ms meanwhile
    worker.join()
    assert result["resp"].status_code == 400 and needle in result["resp"].text, result["resp"].text
    assert max(latencies) < HEALTH_BUDGET_S, latencies


def test_schema_fuzz_findings_are_4xx(engine, model_dir):
    """Two 500s schemathesis found (tests/integration/test_api_fuzz.py): a per-item list on a
    single prompt, and a chat prompt that leaves no room in the context."""
    resp = engine.post("/generate", json={"input_ids": [1, 2, 3], "logprob_start_len": [4],
                                          "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    assert resp.status_code == 400 and "per-item list" in resp.json()["error"]["message"], resp.text
    small = serve_engine(model_dir, context_length=16)
    try:
        resp = httpx.post(f"{small.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc" * 20}]},
                          timeout=30)  # fmt: skip
    finally:
        small.stop()
    assert (
        resp.status_code == 400 and "no room left in the context length 16" in resp.json()["error"]["message"]
    )


def test_the_rollout_sheds_load_past_its_inflight_limit():
    """`InflightLimit`: with one guarded request in progress, the next answers 503 + Retry-After
    at once (and is counted); unguarded paths and later requests go through."""
    from fastapi import FastAPI

    from asyncrl.services.runtime.limits import InflightLimit

    release, entered, refused = threading.Event(), threading.Event(), []
    app = FastAPI()
    app.add_middleware(
        InflightLimit, max_inflight=1, on_refused=lambda: refused.append(1), prefixes=("/v1/",)
    )

    @app.post("/v1/slow")
    def slow() -> dict:
        entered.set()
        release.wait(10)
        return {"ok": True}

    @app.get("/v1/fast")
    def fast() -> dict:
        return {"ok": True}

    http = serve_app_in_thread(app, free_port(), "shed")
    try:
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(httpx.post(f"{http.url}/v1/slow", timeout=30)))
        t.start()
        assert entered.wait(10)
        busy = httpx.post(f"{http.url}/v1/slow", timeout=5)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1" and "overloaded" in busy.text
        assert httpx.get(f"{http.url}/v1/fast", timeout=5).status_code == 200  # GET: not guarded
        release.set()
        t.join(10)
        assert first[0].status_code == 200 and refused == [1]
        assert httpx.post(f"{http.url}/v1/slow", timeout=5).status_code == 200
    finally:
        release.set()
        http.stop()
