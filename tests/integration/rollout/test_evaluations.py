"""Evaluations end to end on loopback: real Redis (fixture), the reference engine (uvicorn
thread, tiny Qwen2), the real reward service (`asyncrl reward` subprocess, toy `reverse`
verifier), the rollout service over HTTP. Nothing is mocked.

Covers: an evaluation pinned at a version survives a weight update published in the middle
of it (no abort, no resubmit, every item at the pinned version, the engine moves on after);
evaluations never reach the training buffer or admission; GET and listing carry the values
the items give; strict accuracy, format rate and accuracy among formatted answers over the
math verifier's format verdicts (a model built to answer in known formats); idempotency keys;
bad bodies → 4xx; Prometheus gauges labelled by version; an update the service does not drive
fails the evaluation it interrupts, saying why; a dead replica's evaluation is recovered; the
API token; behind sglang-router an evaluation pins every worker; automatic evaluations of two
named sets at version 0 and every `eval_every` versions, once across two replicas.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from rollout_server import serve_in_thread, start_reward_service
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, PolicyVersions
from asyncrl.buffer import stats as buffer_stats
from asyncrl.proto import WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 128
CAP = 100
LETTERS = "abcdefghij"


def reverse_reward(target: str, completion: str) -> float:
    """The toy verifier's rule, written out: matched positions / the longer length."""
    return sum(a == b for a, b in zip(completion, target)) / max(len(target), len(completion))


def word(i: int, k: int = 4) -> str:
    return "".join(LETTERS[(i * 7 + j * 3) % len(LETTERS)] for j in range(k))


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_model_v0")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def model_dir_v1(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_model_v1")
    build_tiny_model(path, seed=1, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(log_path=tmp_path_factory.mktemp("reward") / "reward.log")
    yield running
    running.stop()


def start_engine(model_dir: str):
    return serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=CAP, context_length=CONTEXT)


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


def wait_eval(
    client: httpx.Client, eval_id: str, *, timeout_s: float = 60.0, until=("done", "failed")
) -> dict:
    def finished() -> dict | None:
        resp = client.get(f"/v1/evaluations/{eval_id}")
        resp.raise_for_status()
        body = resp.json()
        return body if body["state"] in until else None

    return wait_until(
        finished, timeout=timeout_s, interval=0.05, message=f"evaluation {eval_id} is {' or '.join(until)}"
    )


def engine_version(url: str) -> str:
    return httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"]


def assert_summary_matches_items(result: dict) -> None:
    """The summary's numbers, recomputed here from the items it returned."""
    items = result["items"]
    scored = [i["reward"] for i in items if i["reward_status"] == "scored"]
    correct = sum(1 for r in scored if r >= 1.0)
    assert result["prompts"] == len(items)
    assert result["correct"] == correct and result["scored"] == len(scored)
    assert result["accuracy"] == pytest.approx(correct / len(items))
    formatted = [i for i in items if i["formatted"]]
    if all(i["formatted"] is None for i in items):  # no verifier of the set has a format
        assert (result["formatted"], result["format_rate"], result["formatted_accuracy"]) == (
            None,
            None,
            None,
        )
    else:
        formatless = sum(1 for i in items if i["reward_status"] == "scored" and i["formatted"] is None)
        assert result["formatted"] == len(formatted)
        assert result["format_rate"] == pytest.approx(len(formatted) / (len(items) - formatless))
        right = sum(1 for i in formatted if i["reward"] >= 1.0)
        assert result["formatted_accuracy"] == (pytest.approx(right / len(formatted)) if formatted else None)
    assert result["mean_reward"] == pytest.approx(sum(scored) / len(scored))
    assert result["mean_length"] == pytest.approx(sum(i["completion_tokens"] for i in items) / len(items))
    statuses: dict[str, int] = {}
    for i in items:
        statuses[i["reward_status"]] = statuses.get(i["reward_status"], 0) + 1
    assert result["statuses"] == statuses


# --------------------------------------------------------------------------------- one shared service


@pytest.fixture(scope="module")
def shared(redis_server, reward, model_dir, tokenizer):
    """One engine (version 0 throughout) and one rollout service on a fresh run."""
    run = f"t{uuid.uuid4().hex[:12]}"
    AdmissionControl(Buffer(redis_server.url, run)).configure(batch_groups=64, max_staleness=0)
    engine = start_engine(model_dir)
    running = serve_in_thread(
        redis_server.url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run)
    )
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield client, run, engine
    running.stop()
    engine.stop()


@pytest.fixture(scope="module")
def scored(shared, redis_server):
    """Two greedy evaluations of the same 11 prompts: the second uses the first's completions
    as the exact targets of prompts 0-4 (reward 1), the reverse of the word for 5-9 (partial
    credit), and prompt 10 (" >") has no target at all (`invalid_input`, counted as wrong)."""
    client, run, _ = shared
    admitted0 = metric("asyncrl_rollout_groups_admitted_total")
    prompts = [{"text": word(i) + ">", "reward_spec": {"verifier": "reverse"}} for i in range(10)]
    prompts.append({"text": " >", "reward_spec": {"verifier": "reverse"}, "prompt_id": "no-target"})
    first = client.post("/v1/evaluations", json={"name": "probe", "prompts": prompts})
    assert first.status_code == 202, first.text
    probe = wait_eval(client, first.json()["eval_id"])
    assert probe["state"] == "done", probe
    greedy = [item["completion"] for item in probe["items"]]
    for i in range(5):
        if greedy[i]:
            prompts[i] = {**prompts[i], "reward_spec": {"verifier": "reverse", "target": greedy[i]}}
    resp = client.post(
        "/v1/evaluations",
        json={"name": "arith", "prompts": prompts, "sampling_params": {"max_new_tokens": 8}},
    )
    assert resp.status_code == 202, resp.text
    result = wait_eval(client, resp.json()["eval_id"])
    assert result["state"] == "done", result
    return {"result": result, "prompts": prompts, "greedy": greedy, "admitted0": admitted0, "run": run}


def test_get_and_listing_carry_the_values_of_the_items(shared, scored):
    client, _, _ = shared
    result, prompts = scored["result"], scored["prompts"]
    assert_summary_matches_items(result)
    assert (result["name"], result["source"], result["version"], result["pinned"]) == (
        "arith",
        "api",
        0,
        True,
    )
    assert result["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 8}
    items = result["items"]
    assert [i["index"] for i in items] == list(range(11))
    assert items[10]["prompt_id"] == "no-target" and items[0]["prompt_id"] == "arith-0"
    assert (items[10]["reward_status"], items[10]["reward"]) == ("invalid_input", None)
    assert result["statuses"]["invalid_input"] == 1
    for item, prompt in zip(items[:10], prompts):
        assert item["version"] == 0 and item["finish_reason"] in ("stop", "length")
        assert 1 <= item["completion_tokens"] <= 8
        target = prompt["reward_spec"].get("target") or prompt["text"][:-1][::-1]
        assert item["reward"] == pytest.approx(reverse_reward(target, item["completion"]))
    # Greedy is deterministic: the first evaluation's completions are matched exactly.
    exact = [i for i in range(5) if scored["greedy"][i]]
    assert exact and all(items[i]["reward"] == 1.0 for i in exact)
    assert result["accuracy"] >= len(exact) / 11

    listing = client.get("/v1/evaluations", params={"name": "arith"}).json()["evaluations"]
    assert len(listing) == 1 and "items" not in listing[0]
    assert listing[0] == {k: v for k, v in result.items() if k != "items"}
    every = client.get("/v1/evaluations").json()["evaluations"]
    assert {"probe", "arith"} <= {s["name"] for s in every}
    versions = [s["version"] for s in every if s["version"] is not None]
    assert versions == sorted(versions)


def test_evaluations_never_reach_the_training_buffer(shared, scored, redis_server):
    stats = buffer_stats(Buffer(redis_server.url, scored["run"]))
    assert stats["depth"] == {"jobs": 0, "groups": 0, "deadletter": 0, "stale": 0}
    assert stats["pending"] == {"groups": 0, "jobs": 0}
    assert (stats["admission"]["accepted"], stats["admission"]["running"]) == (0, 0)
    assert "put" not in stats["counters"]
    assert metric("asyncrl_rollout_groups_admitted_total") == scored["admitted0"]


def test_gauges_carry_the_version_label_and_the_values(shared, scored):
    client, _, _ = shared
    result = scored["result"]
    # The gauges are set right after the result is stored, so a reader may see `done` first.
    wait_until(
        lambda: 'name="arith",version="0"' in client.get("/metrics").text, timeout=10, message="arith gauges"
    )
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name, field in (
        ("asyncrl_eval_accuracy", "accuracy"),
        ("asyncrl_eval_mean_reward", "mean_reward"),
        ("asyncrl_eval_mean_length", "mean_length"),
    ):
        samples = {
            (s.labels["name"], s.labels["version"]): s.value
            for s in families[name].samples
            if "name" in s.labels
        }
        assert samples[("arith", "0")] == pytest.approx(result[field]), name
    items = {
        s.labels["status"]: s.value
        for s in families["asyncrl_eval_items"].samples
        if s.name == "asyncrl_eval_items_total"
    }
    assert items["invalid_input"] >= 2 and items["scored"] >= 20  # the probe's and arith's
    done = [s.value for s in families["asyncrl_eval_evaluations"].samples if s.labels.get("result") == "done"]
    assert done and done[0] >= 2


# --------------------------------------------------------------------------------- answer formats

# What the scripted model answers after a prompt's last character: a box, a bare number, noise.
SCRIPT = {"q": "\\boxed{42}", "w": "73", "k": "mnp"}
SCRIPT_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 >\\{}"


def build_scripted_model(path) -> None:
    """A real Qwen2 checkpoint whose greedy continuation of a prompt is `SCRIPT[last char]` then
    EOS: every layer's output projections are zero, so the last position's hidden state is its
    token's embedding (one-hot), and the untied LM head maps each token to the next character
    of its script (EOS after a script's last character and after any other token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.services.ops.tinymodel import EOS_ID

    build_tiny_model(
        path, chars=SCRIPT_CHARS, num_layers=1, tie_word_embeddings=False, max_position_embeddings=CONTEXT
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert vocab <= hidden, "one-hot embeddings need a dimension per token"
    following = {}
    for selector, script in SCRIPT.items():
        chars = [selector, *script]
        following |= dict(zip(chars, chars[1:]))
    assert len(following) == sum(len(v) for v in SCRIPT.values()), "a character may continue one script only"
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):
            text = tok.decode([token])
            head[tok.convert_tokens_to_ids(following[text]) if text in following else EOS_ID, token] = 10.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def scripted(redis_server, reward, tmp_path_factory):
    """The scripted model behind a reference engine and a rollout service on a fresh run."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("scripted_model")
    build_scripted_model(path)
    run = f"t{uuid.uuid4().hex[:12]}"
    engine = start_engine(str(path))
    running = serve_in_thread(
        redis_server.url,
        loaded_tokenizer=AutoTokenizer.from_pretrained(path),
        **settings(engine.url, reward.url, str(path), run),
    )
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield client
    running.stop()
    engine.stop()


def test_format_rate_and_accuracy_among_formatted_answers(scripted):
    """Eight strict-math items whose answers are known in advance: 3 boxed and right (42 for
    42), 2 boxed and wrong (42 for 41), 2 bare right numbers (73 for 73: strict pays no
    unmarked answer), 1 noise. Strict accuracy 3/8, format rate 5/8, accuracy among formatted
    answers 3/5; a `reverse` set over the same answers has no format figures at all."""
    client = scripted
    math = [("q", "42")] * 3 + [("q", "41")] * 2 + [("w", "73")] * 2 + [("k", "5")]
    prompts = [
        {"text": f"a{selector}", "reward_spec": {"verifier": "math", "answer": answer, "strict": True}}
        for selector, answer in math
    ]
    resp = client.post(
        "/v1/evaluations",
        json={"name": "formats", "prompts": prompts, "sampling_params": {"max_new_tokens": 12}},
    )
    assert resp.status_code == 202, resp.text
    result = wait_eval(client, resp.json()["eval_id"])
    assert result["state"] == "done", result
    items = result["items"]
    assert [i["completion"] for i in items] == [SCRIPT[selector] for selector, _ in math]
    assert [(i["reward"], i["formatted"]) for i in items] == [(1.0, True)] * 3 + [(0.0, True)] * 2 + [
        (0.0, False)
    ] * 3
    assert (result["accuracy"], result["formatted"], result["format_rate"], result["formatted_accuracy"]) == (
        3 / 8,
        5,
        5 / 8,
        3 / 5,
    )
    assert_summary_matches_items(result)

    resp = client.post(
        "/v1/evaluations",
        json={"name": "formatless", "prompts": [{"text": "aq"}, {"text": "aw"}], "reward_spec": {"verifier": "reverse"},
              "sampling_params": {"max_new_tokens": 12}},
    )  # fmt: skip
    formatless = wait_eval(client, resp.json()["eval_id"])
    assert [i["formatted"] for i in formatless["items"]] == [None, None]
    assert (formatless["formatted"], formatless["format_rate"], formatless["formatted_accuracy"]) == (
        None,
        None,
        None,
    )

    wait_until(
        lambda: 'name="formatless",version="0"' in client.get("/metrics").text, timeout=10, message="gauges"
    )
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    gauges = {
        (name, s.labels["name"]): s.value
        for name in ("asyncrl_eval_accuracy", "asyncrl_eval_format_rate", "asyncrl_eval_formatted_accuracy")
        for s in families[name].samples
        if s.labels.get("version") == "0" and s.labels["name"] in ("formats", "formatless")
    }
    assert gauges == {
        ("asyncrl_eval_accuracy", "formats"): 3 / 8,
        ("asyncrl_eval_format_rate", "formats"): 5 / 8,
        ("asyncrl_eval_formatted_accuracy", "formats"): 3 / 5,
        ("asyncrl_eval_accuracy", "formatless"): 0.0,  # no format gauge: none was measured, never a 0
    }


def test_idempotency_key_gives_one_evaluation(shared):
    client, _, _ = shared
    body = {
        "name": "idem",
        "prompts": [{"text": word(i) + ">"} for i in range(3)],
        "reward_spec": {"verifier": "reverse"},
        "sampling_params": {"max_new_tokens": 4},
        "idempotency_key": "nightly-7",
    }
    first, second = client.post("/v1/evaluations", json=body), client.post("/v1/evaluations", json=body)
    assert first.status_code == second.status_code == 202
    assert first.json()["eval_id"] == second.json()["eval_id"]
    assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
    conflict = client.post("/v1/evaluations", json={**body, "name": "other"})
    assert conflict.status_code == 409 and "nightly-7" in conflict.json()["detail"]
    result = wait_eval(client, first.json()["eval_id"])
    assert result["state"] == "done"
    third = client.post("/v1/evaluations", json=body)
    assert third.json() == {**first.json(), "state": "done", "duplicate": True}
    assert len(client.get("/v1/evaluations", params={"name": "idem"}).json()["evaluations"]) == 1


def test_bad_bodies_are_refused_with_a_message(shared):
    client, _, _ = shared
    before = client.get("/v1/evaluations").json()["evaluations"]
    refused0 = sum(
        metric("asyncrl_rollout_requests_rejected_total", reason=r)
        for r in ("invalid_body", "malformed_json", "invalid_input", "unknown_verifier", "unknown_eval")
    )
    ok = {"prompts": [{"text": "abcd>"}], "reward_spec": {"verifier": "reverse"}}
    cases = [
        ("malformed json", b'{"prompts": [', 400, "JSON"),
        ("no prompts", {**ok, "prompts": []}, 422, "prompts"),
        ("bad name", {**ok, "name": "has space"}, 422, "name"),
        ("unknown field", {**ok, "group_size": 4}, 422, "group_size"),
        ("empty text", {**ok, "prompts": [{"text": "  "}]}, 422, "empty prompt"),
        ("no reward spec", {"prompts": [{"text": "abcd>"}]}, 422, "reward_spec"),
        ("n > 1", {**ok, "sampling_params": {"n": 2}}, 422, "one completion per prompt"),
        ("negative temperature", {**ok, "sampling_params": {"temperature": -1}}, 422, "temperature"),
        ("over the cap", {**ok, "sampling_params": {"max_new_tokens": CAP + 1}}, 400, f"cap {CAP}"),
        ("too long", {**ok, "prompts": [{"text": "ab" * CONTEXT}]}, 400, "context length"),
        ("unknown verifier", {**ok, "reward_spec": {"verifier": "astrology"}}, 400, "astrology"),
        ("out of vocabulary", {**ok, "prompts": [{"input_ids": [1, 10**6]}]}, 400, "vocabulary"),
    ]
    for name, body, status, needle in cases:
        if isinstance(body, bytes):
            resp = client.post("/v1/evaluations", content=body, headers={"content-type": "application/json"})
        else:
            resp = client.post("/v1/evaluations", json=body)
        assert resp.status_code == status, (name, resp.text)
        message = resp.json().get("message") or resp.json()["detail"]
        assert needle.lower() in str(message).lower(), (name, message)
    missing = client.get("/v1/evaluations/enope")
    assert missing.status_code == 404 and "enope" in missing.json()["detail"]
    assert client.get("/v1/evaluations", params={"name": "no good"}).status_code == 422
    assert client.get("/v1/evaluations").json()["evaluations"] == before  # nothing was created
    refused = sum(
        metric("asyncrl_rollout_requests_rejected_total", reason=r)
        for r in ("invalid_body", "malformed_json", "invalid_input", "unknown_verifier", "unknown_eval")
    )
    assert refused - refused0 == len(cases) + 2


def test_an_evaluation_left_by_a_dead_replica_is_recovered(shared, redis_server, tokenizer):
    """A replica claimed an evaluation and died: once its lease runs out, the live replica
    claims it (second attempt) and runs it to the end."""
    from asyncrl.buffer import EvalStore
    from asyncrl.proto.evals import EvalPrompt, EvalSummary, EvalTask

    client, run, _ = shared
    task = EvalTask(
        prompts=[
            EvalPrompt(
                prompt_id=f"d{i}",
                prompt_tokens=tokenizer(word(i) + ">")["input_ids"],
                prompt_text=word(i) + ">",
                reward_spec={"verifier": "reverse"},
            )
            for i in range(3)
        ],
        sampling_params={"temperature": 0.0, "max_new_tokens": 4},
    )
    summary = EvalSummary(eval_id="edead", name="orphan", source="api", state="running", prompts=3,
                          replica="dead", created_at=time.time())  # fmt: skip
    store = EvalStore(redis_server.url, run=run)
    assert store.create(summary, task, owner="rollout-dead", lease_s=0.5)
    time.sleep(0.3)  # time is the subject: within its 0.5 s lease the dead replica still owns it
    assert client.get("/v1/evaluations/edead").json()["state"] == "running"  # still the dead one's
    result = wait_eval(client, "edead", timeout_s=30)
    assert (result["state"], result["attempts"], result["replica"], result["version"]) == ("done", 2, "r0", 0)
    assert [i["prompt_id"] for i in result["items"]] == ["d0", "d1", "d2"]
    assert_summary_matches_items(result)
    assert store.claim("rollout-other", 1.0) is None  # finished: never handed out again
    store.close()


def test_evaluation_routes_require_the_api_token(monkeypatch, redis_url, run_id, model_dir, tokenizer):
    from fastapi.testclient import TestClient

    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.config import RolloutSettings
    from asyncrl.services.rollout.service import RolloutService

    monkeypatch.setenv("ASYNCRL_API_TOKEN", "s3cret-for-tests")
    s = RolloutSettings(**settings("http://127.0.0.1:9", "http://127.0.0.1:9", model_dir, run_id))
    with TestClient(
        build_app(RolloutService(s, redis_url, tokenizer=tokenizer), run_scheduler=False)
    ) as client:
        for method, path in (
            ("get", "/v1/evaluations"),
            ("get", "/v1/evaluations/e1"),
            ("post", "/v1/evaluations"),
        ):
            assert getattr(client, method)(path).status_code == 401, path
        auth = {"Authorization": "Bearer s3cret-for-tests"}
        assert client.get("/v1/evaluations", headers=auth).json() == {"evaluations": []}
        assert client.get("/v1/evaluations/e1", headers=auth).status_code == 404


# --------------------------------------------------------------------------------- pinning


def in_the_middle(engine, requests: int, tokens: int) -> bool:
    """All `requests` decode on the engine and each has sampled at least `tokens` tokens."""
    running = list(engine.engine.scheduler.running)  # a snapshot; the scheduler thread mutates it
    return len(running) == requests and min(len(r.output_ids) for r in running) >= tokens


def test_pinned_evaluation_survives_a_weight_update(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer
):
    """Freeze the engine mid-evaluation and publish version 1: the update waits for the
    evaluation (nothing aborted or resubmitted, every token at version 0), then the engine moves."""
    engine = start_engine(model_dir)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=1)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    counters = {
        "aborts": ("asyncrl_rollout_aborts_total", {}),
        "resubmits": ("asyncrl_rollout_resubmits_total", {}),
        "engine_aborts": ("asyncrl_engine_requests_finished_total", {"finish_reason": "abort"}),
        "deferred": ("asyncrl_rollout_weight_updates_total", {"method": "disk", "result": "deferred"}),
    }

    def count(key: str) -> float:
        name, labels = counters[key]
        return metric(name, **labels)

    before = {key: count(key) for key in counters}
    try:
        with (
            httpx.Client(base_url=running.url, timeout=30) as client,
            httpx.Client(base_url=engine.url, timeout=30) as eng,
        ):
            body = {
                "name": "pinned",
                "prompts": [{"text": word(i) + ">"} for i in range(6)],
                "reward_spec": {"verifier": "reverse"},
                "sampling_params": {"max_new_tokens": CAP, "ignore_eos": True},
            }
            eval_id = client.post("/v1/evaluations", json=body).json()["eval_id"]
            wait_until(
                lambda: in_the_middle(engine, requests=6, tokens=2),
                timeout=30,
                message="the evaluation started",
            )
            assert eng.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            PolicyVersions(Buffer(redis_url, run_id)).publish(
                WeightsInfo(version=1, method="disk", path=model_dir_v1, published_at=time.time())
            )
            wait_until(
                lambda: count("deferred") > before["deferred"],
                timeout=20,
                message="the weight update is deferred",
            )
            assert engine_version(engine.url) == "0"
            assert client.get(f"/v1/evaluations/{eval_id}").json()["state"] == "running"
            assert eng.post("/continue_generation", json={}).status_code == 200
            result = wait_eval(client, eval_id)
            assert result["state"] == "done", result
            after = {key: count(key) for key in counters}
            wait_until(
                lambda: engine_version(engine.url) == "1", timeout=30, message="the engine moves to version 1"
            )
            # The next evaluation runs at the version the engine serves now.
            later = client.post(
                "/v1/evaluations", json={**body, "name": "later", "sampling_params": {"max_new_tokens": 3}}
            )
            later_result = wait_eval(client, later.json()["eval_id"])
            # An update this replica does not drive (another replica's, or the trainer's broadcast)
            # cannot be deferred: the evaluation it interrupts fails, saying why.
            failed = client.post("/v1/evaluations", json={**body, "name": "interrupted"}).json()["eval_id"]
            wait_until(
                lambda: in_the_middle(engine, requests=6, tokens=2),
                timeout=30,
                message="the evaluation started",
            )
            update = {"model_path": model_dir, "weight_version": "2", "abort_all_requests": True}
            assert eng.post("/update_weights_from_disk", json=update).json()["success"]
            failed_result = wait_eval(client, failed)
    finally:
        running.stop()
        engine.stop()
    assert (result["version"], result["pinned"]) == (0, True)
    assert [i["finish_reason"] for i in result["items"]] == ["length"] * 6
    assert [i["completion_tokens"] for i in result["items"]] == [CAP] * 6
    assert [i["version"] for i in result["items"]] == [0] * 6
    assert_summary_matches_items(result)
    for key in ("aborts", "resubmits", "engine_aborts"):
        assert after[key] == before[key], key
    assert (later_result["state"], later_result["version"]) == ("done", 1)
    assert [i["version"] for i in later_result["items"]] == [1] * 6
    assert (failed_result["state"], failed_result["version"], failed_result["items"]) == ("failed", 1, [])
    assert "aborted" in failed_result["error"]


def test_behind_a_router_an_evaluation_pins_every_worker(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer, tmp_path
):
    """Generation goes through sglang-router, so the worker an item lands on is the router's
    choice: the pin holds back the update of every worker until the evaluation is done."""
    import sys

    from rollout_server import free_port, start_process

    pytest.importorskip(
        "sglang_router", reason="sglang-router is a dev dependency (pip install sglang-router)"
    )
    engines = [start_engine(model_dir), start_engine(model_dir)]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *(e.url for e in engines),
           "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    router = start_process(cmd, f"http://127.0.0.1:{port}", "/health", log_path=tmp_path / "router.log")
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=1)
    fields = settings(
        router.url, reward.url, model_dir, run_id, engine_admin_urls=",".join(e.url for e in engines)
    )
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **fields)
    deferred0 = metric("asyncrl_rollout_weight_updates_total", method="disk", result="deferred")
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {
                "name": "routed",
                "prompts": [{"text": word(i) + ">"} for i in range(4)],
                "reward_spec": {"verifier": "reverse"},
                "sampling_params": {"max_new_tokens": CAP, "ignore_eos": True},
            }
            eval_id = client.post("/v1/evaluations", json=body).json()["eval_id"]

            def decoding() -> list:
                return [r for e in engines for r in list(e.engine.scheduler.running)]

            wait_until(
                lambda: len(decoding()) == 4 and min(len(r.output_ids) for r in decoding()) >= 2,
                timeout=30,
                message="the evaluation started",
            )
            for e in engines:
                assert httpx.post(f"{e.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
            assert client.get(f"/v1/evaluations/{eval_id}").json()["state"] == "running"
            PolicyVersions(Buffer(redis_url, run_id)).publish(
                WeightsInfo(version=1, method="disk", path=model_dir_v1, published_at=time.time())
            )
            wait_until(
                lambda: (
                    metric("asyncrl_rollout_weight_updates_total", method="disk", result="deferred")
                    >= deferred0 + 2
                ),
                timeout=20,
                message="the workers' updates are deferred",
            )
            assert [engine_version(e.url) for e in engines] == ["0", "0"]
            for e in engines:
                assert httpx.post(f"{e.url}/continue_generation", json={}).status_code == 200
            result = wait_eval(client, eval_id)
            wait_until(
                lambda: [engine_version(e.url) for e in engines] == ["1", "1"],
                timeout=30,
                message="the workers moved",
            )
    finally:
        running.stop()
        router.stop()
        for e in engines:
            e.stop()
    assert (result["state"], result["version"], result["engine"]) == ("done", 0, router.url)
    assert [(i["version"], i["completion_tokens"]) for i in result["items"]] == [(0, CAP)] * 4


# --------------------------------------------------------------------------------- automatic evaluations


def test_automatic_evaluations_at_every_eval_every_versions_once_across_replicas(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer, tmp_path
):
    """Two replicas, each driving its own engine, both follow versions 0…4 with eval_every = 2:
    versions 0, 2 and 4 are evaluated exactly once each (by whichever replica got there first),
    for each of two named sets (`eval_file` as "heldout", and `eval_sets`' "heldout-math")."""
    eval_file, math_file = tmp_path / "heldout.jsonl", tmp_path / "heldout-math.jsonl"
    eval_file.write_text(
        "\n".join(
            json.dumps({"text": word(i) + ">", "reward_spec": {"verifier": "reverse"}}) for i in range(4)
        )
    )
    math_file.write_text(
        "\n".join(
            json.dumps(
                {"text": word(i) + ">", "reward_spec": {"verifier": "math", "answer": str(i), "strict": True}}
            )
            for i in range(3)
        )
    )
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=1)
    auto = {
        "eval_file": str(eval_file),
        "eval_sets": {"heldout-math": str(math_file)},
        "eval_every": 2,
        "eval_max_new_tokens": 6,
    }
    created0, exists0 = (metric("asyncrl_eval_auto_total", result=r) for r in ("created", "exists"))
    engines = [start_engine(model_dir), start_engine(model_dir)]
    replicas = []
    try:
        for name, engine in zip("ab", engines):
            fields = settings(engine.url, reward.url, model_dir, run_id, replica=name, **auto)
            replicas.append(serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **fields))
        with httpx.Client(base_url=replicas[0].url, timeout=30) as client:

            def heldout(name: str = "heldout") -> list[dict]:
                return client.get("/v1/evaluations", params={"name": name}).json()["evaluations"]

            wait_until(
                lambda: [s["state"] for s in heldout() + heldout("heldout-math")] == ["done"] * 2,
                timeout=30,
                message="both sets' evaluations at version 0",
            )
            weights = PolicyVersions(Buffer(redis_url, run_id))
            for version in range(1, 5):
                path = model_dir_v1 if version % 2 else model_dir
                weights.publish(
                    WeightsInfo(version=version, method="disk", path=path, published_at=time.time())
                )
                wait_until(
                    lambda v=version: all(engine_version(e.url) == str(v) for e in engines),
                    timeout=30,
                    message=f"the engines reach version {version}",
                )
            wait_until(
                lambda: [s["state"] for s in heldout() + heldout("heldout-math")] == ["done"] * 6,
                timeout=30,
                message="3 evaluations of each set are done",
            )
            time.sleep(0.5)  # time is the subject: nothing else turns up in this while
            summaries, math_summaries = heldout(), heldout("heldout-math")
            results = [client.get(f"/v1/evaluations/{s['eval_id']}").json() for s in summaries]
            math_results = [client.get(f"/v1/evaluations/{s['eval_id']}").json() for s in math_summaries]
            wait_until(
                lambda: 'asyncrl_eval_accuracy{name="heldout",version="4"}' in client.get("/metrics").text,
                timeout=10,
                message="the gauge of version 4 is there",
            )
            metrics_text = client.get("/metrics").text
    finally:
        for r in replicas:
            r.stop()
        for e in engines:
            e.stop()
    assert [s["version"] for s in summaries] == [0, 2, 4]
    assert [s["target_version"] for s in summaries] == [0, 2, 4]
    assert {s["source"] for s in summaries} == {"auto"} and len({s["eval_id"] for s in summaries}) == 3
    assert {s["replica"] for s in summaries} <= {"a", "b"}
    for result in results:
        assert result["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 6}
        assert [i["version"] for i in result["items"]] == [result["version"]] * 4
        assert_summary_matches_items(result)
    assert [s["version"] for s in math_summaries] == [0, 2, 4]
    assert len({s["eval_id"] for s in summaries + math_summaries}) == 6
    for result in math_results:  # the random model writes letters: no marked answer, never right
        assert [(i["version"], i["reward"], i["formatted"]) for i in result["items"]] == [
            (result["version"], 0.0, False)
        ] * 3
        assert (result["accuracy"], result["format_rate"], result["formatted_accuracy"]) == (0.0, 0.0, None)
    assert metric("asyncrl_eval_auto_total", result="created") - created0 == 6
    assert metric("asyncrl_eval_auto_total", result="exists") - exists0 == 6  # the other replica's tries
    for version in (0, 2, 4):
        assert f'asyncrl_eval_accuracy{{name="heldout",version="{version}"}}' in metrics_text
