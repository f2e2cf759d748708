"""The command log's promises on the wire: a retried call (same model, same seq id) applies once
and answers the same future; a different call under a used seq id is refused; a missing seq id
holds the calls behind it, then fails them naming it; limits answer 429/413, auth 401. Bodies
are the SDK's own encodings (its request types and protobuf writer), sent with httpx so a call
can be sent twice."""

from __future__ import annotations

import httpx
import pytest
import redis
from prometheus_client import REGISTRY
from tinker_stack import BASE, KEY, PROTO, fb_body, optim_body, start_stack, tinker_settings, wait_future
from waiting import wait_until


@pytest.fixture
def model(sdk, stack):
    """A model created by the SDK, then driven by hand: (model_id, an httpx client)."""
    client = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=11).result(timeout=120)
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        yield client.model_id, http


def test_a_retried_call_applies_once_and_answers_the_same_future(model, stack):
    mid, http = model
    tokens = list(range(5, 17))
    first = http.post("/api/v1/forward_backward", content=fb_body(mid, 1, tokens), headers=PROTO)
    again = http.post("/api/v1/forward_backward", content=fb_body(mid, 1, tokens), headers=PROTO)
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"]
    step = [http.post("/api/v1/optim_step", json=optim_body(mid, 2)) for _ in range(3)]
    assert len({r.json()["request_id"] for r in step}) == 1
    result = wait_future(http, step[0].json()["request_id"])
    assert result.json()["metrics"]["step"] == 1.0
    assert stack.steps(mid) == 1  # three sends of seq 2, one optimizer step
    # The same seq id with another body is another call: refused, naming the one it clashes with.
    clash = http.post("/api/v1/optim_step", json=optim_body(mid, 2, lr=0.5))
    assert clash.status_code == 400 and "already used by a different call" in clash.json()["detail"]
    # Retried after it ran, it still answers the stored result.
    late = http.post("/api/v1/optim_step", json=optim_body(mid, 2))
    assert late.json()["request_id"] == step[0].json()["request_id"] and stack.steps(mid) == 1


def test_calls_run_in_seq_order_and_a_gap_fails_the_calls_behind_it(model, stack):
    mid, http = model
    tokens = list(range(5, 17))
    # seq 2 (optim_step) arrives before seq 1 (forward_backward): it waits, then runs second.
    step = http.post("/api/v1/optim_step", json=optim_body(mid, 2)).json()["request_id"]
    assert wait_future(http, step, timeout=1.0).status_code == 408
    fb = http.post("/api/v1/forward_backward", content=fb_body(mid, 1, tokens), headers=PROTO).json()[
        "request_id"
    ]
    assert wait_future(http, fb).status_code == 200
    assert wait_future(http, step).json()["metrics"]["step"] == 1.0  # it found the gradients of seq 1
    # seq 3 never comes: seq 4 fails once gap_timeout_s (3 s here) has passed, and 3 is given up.
    behind = http.post("/api/v1/optim_step", json=optim_body(mid, 4)).json()["request_id"]
    failed = wait_future(http, behind).json()
    assert (
        failed["category"] == "user" and "seq id 3" in failed["error"] and "never arrived" in failed["error"]
    )
    late = http.post("/api/v1/forward_backward", content=fb_body(mid, 3, tokens), headers=PROTO)
    assert late.status_code == 400 and "given up" in late.json()["detail"]
    assert stack.steps(mid) == 1
    ok = http.post("/api/v1/optim_step", json=optim_body(mid, 5)).json()["request_id"]
    assert wait_future(http, ok).status_code == 200  # the model goes on after the gap


def test_limits_answer_429_and_413(redis_server, tiny, tinker_root, run_id):
    settings = tinker_settings(
        redis_server.url,
        run_id,
        tinker_root,
        tiny,
        None,
        max_models=1,
        max_queued_commands=1,
        max_body_bytes=4096,
        gap_timeout_s=3.0,
    )
    running, server = start_stack(settings)
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()[
                "session_id"
            ]
            create = {"session_id": sid, "base_model": BASE, "lora_config": {"rank": 4}}
            rid = http.post("/api/v1/create_model", json={**create, "model_seq_id": 0}).json()["request_id"]
            mid = wait_future(http, rid).json()["model_id"]
            second = http.post("/api/v1/create_model", json={**create, "model_seq_id": 1})
            assert second.status_code == 429 and "max_models = 1" in second.json()["detail"]
            # seq 2 waits for seq 1 and fills the queue (max_queued_commands = 1): seq 3 is refused.
            assert http.post("/api/v1/optim_step", json=optim_body(mid, 2)).status_code == 200
            full = http.post("/api/v1/optim_step", json=optim_body(mid, 3))
            assert full.status_code == 429 and "max_queued_commands" in full.json()["detail"]
            big = http.post(
                "/api/v1/forward_backward", content=fb_body(mid, 1, list(range(1, 600))), headers=PROTO
            )
            assert big.status_code == 413 and "4096 bytes" in big.json()["detail"]
            metrics = http.get("/metrics").text
            assert 'asyncrl_tinker_requests_total{outcome="limited",route="create_model"} 1.0' in metrics
            assert f'asyncrl_tinker_model_queued_commands{{model="{mid}"}} 1.0' in metrics
            # Finishing the session releases its model (once its queue is empty: seq 2 fails for
            # the gap at seq 1 after gap_timeout_s), and the slot takes a new one.
            assert (
                http.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code
                == 204
            )
            wait_until(
                lambda: running.service.log.model(mid)["status"] == "unloaded",
                message="the model is released",
            )
            closed = http.post("/api/v1/create_model", json={**create, "model_seq_id": 1})
            assert closed.status_code == 410 and "finished (success)" in closed.json()["detail"]
            new = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()
            again = {**create, "session_id": new["session_id"], "model_seq_id": 0}
            rid = http.post("/api/v1/create_model", json=again).json()["request_id"]
            assert wait_future(http, rid).json()["model_id"] == f"{new['session_id']}:train:0"
    finally:
        server.stop()


def test_auth_takes_the_sdks_x_api_key_and_the_bearer_token(redis_server, tiny, tinker_root, run_id):
    import tinker

    settings = tinker_settings(redis_server.url, run_id, tinker_root, tiny, None, api_token=KEY)
    running, server = start_stack(settings)
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            route = "/api/v1/get_server_capabilities"
            assert http.get(route).status_code == 401
            assert http.get(route, headers={"X-API-Key": "tml-wrong-key-0123456789abcdef"}).status_code == 401
            assert (
                http.get(route, headers={"X-API-Key": KEY}).json()["supported_models"][0]["model_name"]
                == BASE
            )
            assert http.get(route, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert http.get("/healthz").status_code == 200 and http.get("/metrics").status_code == 200
        client = tinker.ServiceClient(base_url=running.url, api_key=KEY)
        sampler_ok = client.create_lora_training_client(base_model=BASE, rank=4).result(timeout=120)
        assert sampler_ok.get_info().lora_rank == 4
        client.close("success").result(timeout=60)
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=running.url, api_key="tml-wrong-key-0123456789abcdef").create_lora_training_client(
                base_model=BASE, rank=4
            ).result(timeout=120)  # fmt: skip
    finally:
        server.stop()


def test_a_retried_sampler_save_is_the_same_call_whatever_sampling_session_it_names(model, stack):
    # The SDK draws `sampling_session_seq_id` inside the function its retry loop calls again
    # (training_client.py `_save_weights_for_sampler_impl`): a resend after a lost answer names
    # the next one. It is still the same call (same model, seq id, everything else).
    mid, http = model
    first, again = (
        http.post("/api/v1/save_weights_for_sampler", json={"model_id": mid, "seq_id": 1, "sampling_session_seq_id": n})
        for n in (5, 6)
    )  # fmt: skip
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"]
    done = wait_future(http, first.json()["request_id"]).json()
    assert done["sampling_session_id"].endswith(":sample:5") and done["path"].endswith(
        "/sampler_weights/seq1"
    )
    other = http.post("/api/v1/save_weights_for_sampler", json={"model_id": mid, "seq_id": 1, "path": "x"})
    assert other.status_code == 400 and "already used by a different call" in other.json()["detail"]


def test_a_sample_call_is_bounded_in_samples_and_prompt_tokens(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()[
            "session_id"
        ]
        session = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE}
        sampler = http.post("/api/v1/create_sampling_session", json=session).json()["sampling_session_id"]

        def sample(tokens: list[int], n: int) -> httpx.Response:
            return http.post("/api/v1/asample", json={
                "sampling_session_id": sampler, "num_samples": n, "sampling_params": {"max_tokens": 1},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            })  # fmt: skip

        limit = stack.settings.max_samples_per_call
        many = sample([5, 6], limit + 1)
        assert many.status_code == 400 and f"max_samples_per_call ({limit})" in many.json()["detail"]
        long = sample([5] * (stack.settings.max_tokens_per_call + 1), 1)
        assert long.status_code == 400 and "max_tokens_per_call" in long.json()["detail"]
        ok = sample([5, 6], 2).json()
        assert len(ok["sample_sequence_ids"]) == 2
        assert wait_future(http, ok["request_id"]).status_code == 200


def test_a_sample_that_fails_unexpectedly_fails_its_future_and_is_counted(stack, monkeypatch):
    """Not a 410 (which has the SDK send it again, and again: the same fault each time): a
    failed future (`server`), counted. The fault is injected: the sampler raising what no
    branch expects (a bug, an engine answer that breaks a parse)."""

    async def broken(request, session):
        raise LookupError("an engine answer this code did not expect")

    monkeypatch.setattr(stack.service.sampler, "sample", broken)
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()[
            "session_id"
        ]
        session = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE}
        sampler = http.post("/api/v1/create_sampling_session", json=session).json()["sampling_session_id"]
        before = sample_errors()
        rid = http.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 1},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        }).json()["request_id"]  # fmt: skip
        failed = wait_future(http, rid)
        assert failed.status_code == 200 and failed.json()["category"] == "server"
        assert "LookupError: an engine answer this code did not expect" in failed.json()["error"]
        assert sample_errors() == before + 1


def test_a_malformed_session_finish_is_a_4xx_naming_it(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()[
            "session_id"
        ]
        route = f"/api/v1/sessions/{sid}/finish"
        for body in (b"not json", b'{"reason": "success"}', b"[1, 2]"):
            refused = http.post(route, content=body, headers={"Content-Type": "application/json"})
            assert refused.status_code in (400, 422) and "detail" in refused.json(), (body, refused.text)
        assert http.post(route, json={"reason": {"type": "success"}, "detail": None}).status_code == 204
        assert stack.service.log.session(sid)["finished"] == "success"


def test_a_call_finishing_between_a_polls_read_and_its_wait_wakes_the_poll(
    redis_server, tiny, tinker_root, run_id, monkeypatch
):
    """The race a long poll must not lose: the worker finishes the call (and notifies) after the
    poll read it unfinished and before the poll waits. The read is made to race so; a wake-up
    lost there holds the poll its whole `poll_hold_s` (40 s), past the 20 s this test allows."""
    import asyncio

    from asyncrl.services.tinker.commands import CommandLog
    from asyncrl.services.tinker.service import TinkerService

    settings = tinker_settings(redis_server.url, run_id, tinker_root, tiny, None, poll_hold_s=40.0)
    log = CommandLog(redis.Redis.from_url(redis_server.url), run_id, max_queued=4, result_ttl_s=600)
    service = TinkerService(settings, log, None, None)  # no backend: nothing here runs a command
    rid = log.new_future("probe")
    read = log.future

    def racing(request_id: str) -> dict | None:
        record = read(request_id)
        if record["state"] == "running":  # the worker's finish and notify, on its own thread
            log.settle(request_id, result={"answer": 42})
            service.waiters.notify(request_id)
        return record

    monkeypatch.setattr(log, "future", racing)

    async def poll() -> dict | None:
        service.waiters.loop = asyncio.get_running_loop()
        return await asyncio.wait_for(service.retrieve(rid), 20)

    record = asyncio.run(poll())
    assert record["state"] == "done" and record["result"] == {"answer": 42}
    log.redis.close()


def test_a_session_that_stops_heartbeating_expires_and_frees_its_models(
    redis_server, tiny, tinker_root, run_id
):
    """A client that dies without closing its session (the SDK's `close` never sent) must not hold
    its models' memory and `max_models` slots for good: past `session_timeout_s` without a
    heartbeat the session is over, its models are released once their queues are empty, and
    its heartbeat answers 410, on which the SDK stops heartbeating."""
    settings = tinker_settings(
        redis_server.url, run_id, tinker_root, tiny, None, max_models=1, session_timeout_s=2.0
    )
    running, server = start_stack(settings)
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()[
                "session_id"
            ]
            create = {"session_id": sid, "base_model": BASE, "lora_config": {"rank": 4}, "model_seq_id": 0}
            mid = wait_future(
                http, http.post("/api/v1/create_model", json=create).json()["request_id"]
            ).json()["model_id"]
            wait_until(
                lambda: running.service.log.model(mid)["status"] == "unloaded",
                message="the silent session's model is released",
            )
            assert running.service.log.session(sid)["finished"] == "expired"
            beat = http.post("/api/v1/session_heartbeat", json={"session_id": sid})
            assert beat.status_code == 410 and "expired" in beat.json()["detail"]
            other = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()
            again = {**create, "session_id": other["session_id"]}
            rid = http.post("/api/v1/create_model", json=again).json()["request_id"]  # the slot is free
            assert wait_future(http, rid).json()["model_id"] == f"{other['session_id']}:train:0"
            assert (REGISTRY.get_sample_value("asyncrl_tinker_sessions_expired_total") or 0.0) >= 1.0
    finally:
        server.stop()


def test_a_sampler_whose_weights_were_pruned_is_refused_naming_why(sdk, stack):
    """Unnamed sampler saves are pruned past the newest keep_sampler_versions (here: deleted by
    hand); a sample on one is the client's error, saying so, not an engine failure."""
    import shutil

    import tinker
    from tinker import types

    client = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=12).result(timeout=120)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=120)
    session = stack.service.log.record("sampler", sampler._sampling_session_id)
    shutil.rmtree(session["adapter_path"])
    with pytest.raises(tinker.RequestFailedError, match="save with a name to keep one") as failed:
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=1)).result(
            timeout=120
        )
    assert failed.value.category == tinker.types.RequestErrorCategory.User


def test_a_checkpoint_name_the_backend_refuses_is_refused_at_the_call(model):
    """One rule for a name (proto/tinker.py CHECKPOINT_NAME): a name the backend cannot write is
    a 400 when the call arrives, not a call accepted and failed later."""
    mid, http = model
    for seq, name in enumerate(("..", ".", "-x", "a/b", "x" * 129), start=1):
        refused = http.post("/api/v1/save_weights", json={"model_id": mid, "seq_id": seq, "path": name})
        assert refused.status_code == 400 and "checkpoint name" in refused.json()["detail"], name
    ok = http.post("/api/v1/save_weights", json={"model_id": mid, "seq_id": 1, "path": "v1.best-2_x"})
    assert wait_future(http, ok.json()["request_id"]).json()["path"].endswith("/weights/v1.best-2_x")


def test_an_unnamed_sampler_saves_records_expire_and_a_named_ones_stay(model, stack):
    """The cookbook saves unnamed sampler weights every step: their index records (the
    checkpoint and its sampling session) live `result_ttl_s`, as the adapters themselves are
    pruned; a named save's stay, as its adapter does."""
    mid, http = model
    log = stack.service.log
    body = {"model_id": mid, "seq_id": 1, "sampling_session_seq_id": 0}
    unnamed = wait_future(http, http.post("/api/v1/save_weights_for_sampler", json=body).json()["request_id"])
    named_body = {"model_id": mid, "seq_id": 2, "path": "keep-me"}
    named = wait_future(
        http, http.post("/api/v1/save_weights_for_sampler", json=named_body).json()["request_id"]
    )
    ttl = stack.settings.result_ttl_s
    for key in (
        log.key("ckpt", unnamed.json()["path"]),
        log.key("sampler", unnamed.json()["sampling_session_id"]),
    ):
        assert 0 < log.redis.ttl(key) <= ttl, key
    assert log.redis.ttl(log.key("ckpt", named.json()["path"])) == -1  # no expiry


def sample_errors() -> float:
    """The service runs in this process: its counters are in the default registry."""
    return REGISTRY.get_sample_value("asyncrl_tinker_samples_total", {"outcome": "error"}) or 0.0
