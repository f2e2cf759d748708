"""The reference engine over real HTTP (uvicorn on a loopback port, in a thread) with a real
tiny transformers model: logprobs against teacher forcing, batching, abort, pause, seeds,
finish reasons, bad input, SGLang response shapes, chat completions and metrics."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_server import serve_in_thread
from waiting import wait_until

from asyncrl.proto.sglang import GenerateResponse
from asyncrl.services.ops.tinymodel import EOS_ID, build_tiny_model

torch.set_num_threads(1)

CONTEXT = 256
CAP = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine_model")
    build_tiny_model(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_in_thread(
        model_dir, max_running_requests=16, max_new_tokens_cap=CAP, context_length=CONTEXT, seed=0
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def generate(client, **body) -> dict:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(client) -> dict:
    return client.get("/get_server_info").json()["internal_states"][0]


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each output position: [len(output), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


PROMPT = [1, 5, 6, 7, 8]


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["temperature1", "greedy"])
def test_logprobs_equal_teacher_forcing(client, hf_model, temperature):
    params = {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True, "sampling_seed": 7}
    out = generate(client, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    tokens = out["output_ids"]
    assert len(tokens) == 24
    expected = teacher_forced(hf_model[0], PROMPT, tokens)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = expected.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    if temperature == 0.0:
        assert tokens == expected.argmax(dim=-1).tolist()


def test_logprobs_are_of_the_filtered_distribution(client, hf_model):
    """temperature 0.7 + top_k 5: logprob = log_softmax over the 5 kept tokens of logits/0.7."""
    params = {"max_new_tokens": 12, "temperature": 0.7, "top_k": 5, "ignore_eos": True, "sampling_seed": 3}
    out = generate(client, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    tokens = out["output_ids"]
    raw = teacher_forced(hf_model[0], PROMPT, tokens) / 0.7
    top = raw.topk(5, dim=-1)
    for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert tok in top.indices[i].tolist(), "a token outside the top-5 was sampled"
        want = torch.log_softmax(top.values[i], dim=-1)[top.indices[i].tolist().index(tok)]
        assert abs(lp - float(want)) <= 1e-4


def test_concurrent_requests_are_batched_and_match_solo_runs(client):
    prompts = [[1, 5 + i, 6 + i, 7] for i in range(8)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    solo = [generate(client, input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
    before = stats(client)
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda p: generate(client, input_ids=p, sampling_params=params, return_logprob=True), prompts
            )
        )
    after = stats(client)
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    assert tokens == 8 * 16
    assert steps < tokens / 2, f"{steps} decode steps for {tokens} tokens: requests were not batched"
    assert after["max_decode_batch"] >= 4
    for a, b in zip(solo, together):
        assert a["output_ids"] == b["output_ids"]
        for (lp_a, _, _), (lp_b, _, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            assert abs(lp_a - lp_b) <= 1e-4


def test_batch_request_body(client):
    out = client.post(
        "/generate",
        json={
            "input_ids": [PROMPT, PROMPT[:3]],
            "rid": ["r-a", "r-b"],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    ).json()
    assert [o["meta_info"]["id"] for o in out] == ["r-a", "r-b"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 3]
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, 0]  # distinct prompts: nothing shared


def test_a_groups_shared_prompt_is_reported_as_cached(client):
    """A group's samples share their prompt: the engine prefills it once, and like SGLang on a
    prefix-cache hit reports the copies' `cached_tokens` (prompt length - 1: SGLang always
    computes the last position); the first of them and a distinct prompt report 0."""

    def cached_total() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("asyncrl_engine_cached_tokens_total "):
                return float(line.split()[1])
        raise AssertionError("asyncrl_engine_cached_tokens_total not exported")

    before = cached_total()
    out = client.post(
        "/generate",
        json={"input_ids": [PROMPT, PROMPT, PROMPT[:3], PROMPT],
              "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}},
    ).json()  # fmt: skip
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, len(PROMPT) - 1, 0, len(PROMPT) - 1]
    assert cached_total() - before == 2 * (len(PROMPT) - 1)


def _in_background(client, body):
    box: dict = {}

    def run():
        box["resp"] = client.post("/generate", json=body)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_abort_by_rid_returns_partial_output(client):
    body = {
        "input_ids": PROMPT,
        "rid": "abort-me",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": CAP, "temperature": 0, "ignore_eos": True},
    }
    base = stats(client)["generated_tokens"]
    thread, box = _in_background(client, body)
    wait_until(lambda: stats(client)["generated_tokens"] >= base + 3, interval=0.01, message="3 tokens out")
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    thread.join(20)
    assert client.post("/continue_generation").status_code == 200
    out = box["resp"].json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 3 <= meta["completion_tokens"] < CAP
    assert len(out["output_ids"]) == len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    # the partial tokens are the same as an unaborted greedy run's prefix
    full = generate(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": meta["completion_tokens"], "temperature": 0, "ignore_eos": True},
    )
    assert full["output_ids"] == out["output_ids"]


def test_abort_all_and_waiting_requests(client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    bodies = [
        {"input_ids": PROMPT, "rid": f"all-{i}", "sampling_params": {"max_new_tokens": 50}} for i in range(3)
    ]
    threads = [_in_background(client, b) for b in bodies]
    wait_until(lambda: stats(client)["num_waiting_reqs"] == 3, interval=0.01, message="3 requests wait")
    assert client.post("/flush_cache").status_code == 400  # requests in flight
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    for thread, box in threads:
        thread.join(20)
        meta = box["resp"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == 0  # aborted while waiting: nothing was generated
    assert client.post("/continue_generation").status_code == 200
    assert client.post("/flush_cache").status_code == 200


def test_pause_retract_then_continue_finishes_normally(client):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
    }
    reference = generate(client, **body)["output_ids"]
    base = stats(client)["generated_tokens"]
    thread, box = _in_background(client, body)
    wait_until(lambda: stats(client)["generated_tokens"] >= base + 2, interval=0.01, message="2 tokens out")
    assert client.post("/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
    assert stats(client)["num_running_reqs"] == 0
    assert client.post("/continue_generation").status_code == 200
    thread.join(20)
    out = box["resp"].json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert out["output_ids"] == reference  # KV recomputed from the tokens so far, same result


def test_seed_determinism(client):
    params = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}
    a = generate(client, input_ids=PROMPT, sampling_params={**params, "sampling_seed": 11})
    b = generate(client, input_ids=PROMPT, sampling_params={**params, "sampling_seed": 11})
    c = generate(client, input_ids=PROMPT, sampling_params={**params, "seed": 12})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_finish_reasons(client):
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    tokens = generate(client, input_ids=PROMPT, sampling_params=greedy)["output_ids"]
    stop = tokens[4]
    out = generate(client, input_ids=PROMPT, sampling_params={**greedy, "stop_token_ids": [stop]})
    first = tokens.index(stop)
    assert out["output_ids"] == tokens[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = generate(client, input_ids=PROMPT, sampling_params={**greedy, "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    # EOS: find a seed whose ignore_eos sample contains EOS, then without ignore_eos it stops there.
    sampled = {"max_new_tokens": 150, "temperature": 1.5}
    for seed in range(20):
        free = generate(
            client, input_ids=PROMPT, sampling_params={**sampled, "ignore_eos": True, "sampling_seed": seed}
        )
        if EOS_ID in free["output_ids"]:
            break
    else:
        pytest.fail("no seed produced EOS")
    assert len(free["output_ids"]) == 150  # ignore_eos kept going past EOS
    stopped = generate(client, input_ids=PROMPT, sampling_params={**sampled, "sampling_seed": seed})
    cut = free["output_ids"].index(EOS_ID) + 1
    assert stopped["output_ids"] == free["output_ids"][:cut]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}


def test_context_length_clips_with_length_finish(client):
    prompt = [1] + [5] * (CONTEXT - 11)
    out = generate(
        client,
        input_ids=prompt,
        sampling_params={"max_new_tokens": 100, "temperature": 0, "ignore_eos": True},
    )
    assert out["meta_info"]["completion_tokens"] == 10
    assert out["meta_info"]["finish_reason"]["type"] == "length"


BAD_INPUTS = [
    ({"input_ids": []}, 400, "empty prompt"),
    ({"text": ""}, 400, "empty prompt"),
    ({"text": 5}, 422, "text"),
    ({"input_ids": [1, "a"]}, 422, "input_ids"),
    ({"text": "a", "input_ids": [1]}, 422, "exactly one"),
    ({"input_ids": [1] * CONTEXT}, 400, "context length"),
    ({"input_ids": [1, 10_000]}, 400, "vocabulary"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, 422, "temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": 1e9}}, 422, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, 422, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": -5}}, 422, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": CAP + 1}}, 400, "exceeds the cap"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 422, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, 422, "bogus"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, 400, "constrained decoding"),
    (
        {"input_ids": [1], "sampling_params": {"json_schema": '{"type": "object"}'}},
        400,
        "constrained decoding (json_schema)",
    ),
    ({"input_ids": [1], "sampling_params": {"ebnf": 'root ::= "a"'}}, 400, "constrained decoding (ebnf)"),
    ({"input_ids": [1], "stream": True}, 400, "stream"),
    # A batch shares one sampling params object; what differs per item is still checked per item.
    (
        {"input_ids": [[1], [1]], "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": [0, 2]},
        400,
        "top_logprobs_num > 0",
    ),  # fmt: skip
    ({"input_ids": [[1], [1] * CONTEXT]}, 400, "context length"),
    (
        {"input_ids": [[1], [1]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": CAP + 1}]},
        400,
        "exceeds the cap",
    ),  # fmt: skip
]


@pytest.mark.parametrize("body,status,needle", BAD_INPUTS, ids=[n for _, _, n in BAD_INPUTS])
def test_bad_input_is_refused_with_a_message(client, body, status, needle):
    before = _metric(client, 'asyncrl_engine_requests_rejected_total{reason="invalid_input"}') + _metric(
        client, 'asyncrl_engine_requests_rejected_total{reason="malformed"}'
    )
    resp = client.post("/generate", json=body)
    assert resp.status_code == status, resp.text
    assert needle in resp.text
    after = _metric(client, 'asyncrl_engine_requests_rejected_total{reason="invalid_input"}') + _metric(
        client, 'asyncrl_engine_requests_rejected_total{reason="malformed"}'
    )
    assert after == before + 1


def test_malformed_json(client):
    resp = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert "json" in resp.text.lower()


def test_response_shape_matches_sglang(client, hf_model):
    tokenizer = hf_model[1]
    out = generate(
        client,
        text="ab",
        rid="shape-1",
        sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    GenerateResponse.model_validate(out)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "output_token_logprobs",
        "input_token_logprobs",
    } <= set(meta)
    assert meta["id"] == "shape-1" and meta["weight_version"] == "0"
    prompt_ids = tokenizer("ab")["input_ids"]
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == 5
    for lp, tok, text in meta["output_token_logprobs"]:
        assert isinstance(lp, float) and lp <= 0 and text == tokenizer.decode([tok])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_chat_completions_round_trip(client, hf_model):
    tokenizer = hf_model[1]
    messages = [{"role": "user", "content": "2+2=?"}]
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["index"] == 0
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    same = generate(client, input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert choice["message"]["content"] == same["text"]
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": same["meta_info"]["completion_tokens"],
        "total_tokens": len(ids) + same["meta_info"]["completion_tokens"],
    }
    # the answer's keys are the engine's own (proto/openai.py's optional fields left out)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(choice) == {"index", "message", "finish_reason", "logprobs"} and choice["logprobs"] is None
    assert set(choice["message"]) == {"role", "content"}
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
    refused = client.post("/v1/chat/completions", json={"messages": messages, "stop": ["\n"], "user": "u1"})
    assert refused.status_code == 400 and "stop" in refused.text  # never silently ignored
    for field, value in (
        ("tools", [{"function": {"name": "f"}}]),
        ("frequency_penalty", 0.5),
        ("session_id", "s"),
        # values the gateway's typed body would refuse (422) are the engine's to refuse, as
        # not served (400), whatever their type
        ("stop", 5),
        ("tool_choice", "required"),
        ("frequency_penalty", 3),
        ("top_logprobs", 5),
    ):
        refused = client.post("/v1/chat/completions", json={"messages": messages, field: value})
        assert refused.status_code == 400 and field in refused.text, field
    # harmless fields are taken as given, and so are seeds of the engine's whole range
    for extra in ({"stream_options": True}, {"seed": 2**63}, {"user": 5}):
        taken = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **extra})
        assert taken.status_code == 200, (extra, taken.text)
    # text messages only, valid Unicode: refused as an invalid body
    for bad in (
        {"role": "user"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": "\ud800"},
    ):
        raw = json.dumps({"messages": [bad]})  # (ASCII escapes: a lone surrogate reaches the server)
        answer = client.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 422, (bad, answer.text)
    # any role the chat template takes (the gateway's five are its own check)
    narrator = [{"role": "narrator", "content": "once"}, *messages]
    assert (
        client.post("/v1/chat/completions", json={"messages": narrator, "max_tokens": 1}).status_code != 422
    )
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics(client):
    tokens_before = _metric(client, "asyncrl_engine_generated_tokens_total")
    ttft_before = _metric(client, "asyncrl_engine_time_to_first_token_seconds_count")
    finished_before = _metric(client, 'asyncrl_engine_requests_finished_total{finish_reason="length"}')
    generate(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 9, "ignore_eos": True})
    assert _metric(client, "asyncrl_engine_generated_tokens_total") == tokens_before + 9
    assert _metric(client, "asyncrl_engine_time_to_first_token_seconds_count") == ttft_before + 1
    assert (
        _metric(client, 'asyncrl_engine_requests_finished_total{finish_reason="length"}')
        == finished_before + 1
    )
    assert _metric(client, "asyncrl_engine_running_requests") == 0
    assert _metric(client, "asyncrl_engine_queued_requests") == 0
    assert _metric(client, "asyncrl_engine_generation_tokens_per_second") > 0


def test_health_and_info(client, model_dir):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == model_dir and info["is_generation"] is True
    assert info["architectures"] == ["Qwen2ForCausalLM"]


def test_cli_entry_point_serves(model_dir):
    """`asyncrl engine` as its own process: settings from flags, real uvicorn, then shut down."""
    import os
    import subprocess
    import sys

    from engine_server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.services.ops.cli",
            "engine",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--context-length",
            "128",
            "--weight-version",
            "7",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _responds(url), message="the engine responds")
        info = httpx.get(f"{url}/get_server_info").json()
        assert info["context_length"] == 128 and info["num_threads"] == 1
        out = httpx.post(
            f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        ).json()
        assert out["meta_info"]["weight_version"] == "7" and len(out["output_ids"]) <= 2
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM to exit with the default status
        assert proc.wait(timeout=30) in (0, -15)


def _responds(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
