"""What the rollout service refuses at `POST /v1/rollouts`, and how a job whose groups all failed
reads. Real Redis (fixture), the reference engine (uvicorn thread, tiny Qwen2), the real reward
service (`asyncrl reward` subprocess), the rollout service over HTTP; nothing is mocked.

Covers: a reward spec whose arguments its verifier's own model refuses → 422 naming the prompt
and the field, nothing queued or generated; valid specs of several verifiers still accepted;
sampling params the reference engine refuses (`stop`, `logit_bias`, …) → 400 naming them,
while an engine of unknown kind judges them itself; a job whose every group was scored by
no sample, or refused by the engine, reads `failed` with its errors; a partly failed one reads
`done` with honest counts. Every refusal is counted by reason.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_reward_service, wait_job

from asyncrl.buffer import AdmissionControl, Buffer
from asyncrl.buffer import stats as buffer_stats
from asyncrl.services.ops.tinymodel import BOS_ID, build_tiny_model

torch.set_num_threads(1)

CONTEXT = 64
ENGINE_CAP = 8  # the engine's max_new_tokens cap; the rollout's is higher on purpose (see below)
ROLLOUT_CAP = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("validation_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_engine(
        model_dir, max_running_requests=16, max_new_tokens_cap=ENGINE_CAP, context_length=CONTEXT
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(log_path=tmp_path_factory.mktemp("reward") / "reward.log")
    yield running
    running.stop()


def start_rollout(redis_url: str, run_id: str, engine_url: str, reward_url: str, model_dir: str, tokenizer):
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=16, max_staleness=0)
    return serve_in_thread(
        redis_url,
        loaded_tokenizer=tokenizer,
        run=run_id,
        replica="r0",
        engine_urls=engine_url,
        reward_url=reward_url,
        tokenizer=model_dir,
        max_new_tokens_cap=ROLLOUT_CAP,
        default_max_new_tokens=4,
        default_group_size=2,
        heartbeat_s=0.3,
        recover_idle_s=1.5,
        claim_poll_s=0.05,
        admission_poll_s=0.05,
        engine_backoff_s=0.05,
    )


@pytest.fixture
def rollout(redis_url, run_id, engine, reward, model_dir, tokenizer):
    running = start_rollout(redis_url, run_id, engine.url, reward.url, model_dir, tokenizer)
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield client
    running.stop()


def sample_sum(name: str, **labels: str) -> float:
    """Sum of a metric's samples (over the labels not given) in this process's registry: the
    engine and the rollout service both run in threads of the test process."""
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def engine_requests() -> float:
    """Requests the engine answered or refused: any generation at all moves this."""
    return sample_sum("asyncrl_engine_requests_finished_total") + sample_sum(
        "asyncrl_engine_requests_rejected_total"
    )


def rejected(reason: str) -> float:
    return sample_sum("asyncrl_rollout_requests_rejected_total", reason=reason)


def nothing_queued(redis_url: str, run_id: str) -> bool:
    stats = buffer_stats(Buffer(redis_url, run_id))
    return (stats["depth"]["jobs"], stats["depth"]["groups"], stats["counters"].get("jobs_enqueued", 0)) == (
        0,
        0,
        0,
    )


# --------------------------------------------------------------------------------- reward specs


def test_a_reward_spec_its_verifier_refuses_is_refused_before_anything_runs(rollout, redis_url, run_id):
    engine_before, refused_before = engine_requests(), rejected("invalid_reward_spec")
    body = {
        "prompts": [
            {"text": "abcd>"},
            {"text": "bcde>", "reward_spec": {"verifier": "reverse", "target": 123, "colour": "red"}},
        ],
        "reward_spec": {"verifier": "reverse"},
    }
    resp = rollout.post("/v1/rollouts", json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"] == (
        "invalid reward_spec: prompts.1.reward_spec.target: Input should be a valid string (reverse); "
        "prompts.1.reward_spec.colour: Extra inputs are not permitted (reverse)"
    )
    # a huge unknown key and a huge value come back cut, not echoed
    huge = {"verifier": "reverse", "x" * 50_000: 1, "target": ["y" * 50_000]}
    resp = rollout.post("/v1/rollouts", json={"prompts": [{"text": "ab>", "reward_spec": huge}] * 20})
    assert resp.status_code == 422 and len(resp.content) < 2_000, resp.content[:300]
    assert resp.json()["detail"].endswith("(20 invalid specs in all)")
    # a job-level spec is named as such; arith's own validator runs too
    resp = rollout.post(
        "/v1/rollouts",
        json={"prompts": [{"text": "ab>"}], "reward_spec": {"verifier": "arith", "answer": "seven"}},
    )
    assert resp.status_code == 422 and resp.json()["detail"].startswith(
        "invalid reward_spec: reward_spec.answer: Value error, answer must be an integer"
    ), resp.text
    assert rejected("invalid_reward_spec") - refused_before == 3
    assert engine_requests() == engine_before
    assert nothing_queued(redis_url, run_id)


def test_valid_specs_of_several_verifiers_are_still_accepted_and_scored(rollout):
    body = {
        "prompts": [
            {"text": "abcd>"},
            {"text": "abcd>", "reward_spec": {"verifier": "reverse", "target": "dcba"}},
            {"text": "1+2=", "reward_spec": {"verifier": "arith", "answer": 3, "format_credit": 0.1}},
        ],
        "reward_spec": {"verifier": "reverse"},
    }
    resp = rollout.post("/v1/rollouts", json=body)
    assert resp.status_code == 202, resp.text
    progress = wait_job(rollout, resp.json()["job_id"], timeout_s=60)
    assert (progress["state"], progress["buffered"], progress["failed"]) == ("done", 3, 0)
    assert (progress["unscored"], progress["unscored_samples"], progress["errors"]) == (0, {}, {})


# --------------------------------------------------------------------------------- sampling params


def test_sampling_params_the_reference_engine_refuses_are_refused_at_post(rollout, redis_url, run_id):
    engine_before = engine_requests()
    refused_before = rejected("unsupported_sampling_params")
    ok = {"prompts": [{"text": "abcd>"}], "reward_spec": {"verifier": "reverse"}}
    for params, named in (
        ({"logit_bias": {"5": 2.0}}, "logit_bias"),
        ({"stop": "x", "regex": "a+", "repetition_penalty": 1.2}, "repetition_penalty, regex"),
    ):
        resp = rollout.post("/v1/rollouts", json={**ok, "sampling_params": params})
        assert resp.status_code == 400, resp.text
        assert resp.json()["detail"].startswith(
            f"sampling_params {named}: not supported by the reference engine"
        )
    assert rejected("unsupported_sampling_params") - refused_before == 2
    assert engine_requests() == engine_before
    assert nothing_queued(redis_url, run_id)
    # what the reference engine does support still goes through
    resp = rollout.post(
        "/v1/rollouts",
        json={**ok, "sampling_params": {"stop_token_ids": [5], "stop": ["\n"], "ignore_eos": True}},
    )
    assert resp.status_code == 202, resp.text
    assert wait_job(rollout, resp.json()["job_id"], timeout_s=60)["state"] == "done"


def test_an_engine_of_unknown_kind_judges_sampling_params_itself(
    redis_url, run_id, reward, model_dir, tokenizer
):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine kind cannot be told
    running = start_rollout(redis_url, run_id, nowhere, reward.url, model_dir, tokenizer)
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            body = {
                "prompts": [{"text": "ab>"}],
                "reward_spec": {"verifier": "reverse"},
                "sampling_params": {"stop": ["\n"]},
            }
            resp = client.post("/v1/rollouts", json=body)
            assert resp.status_code == 202, resp.text
    finally:
        running.stop()


# --------------------------------------------------------------------------------- failed jobs


def test_a_job_whose_every_group_went_unscored_reads_failed(rollout, redis_url, run_id):
    unscored_before = sample_sum("asyncrl_rollout_groups_unscored_total")
    # `reverse` without a target reverses the prompt text; [BOS] decodes to no text at all, so
    # every sample is `invalid_input` (empty_target) at the reward service.
    body = {"prompts": [{"input_ids": [BOS_ID]}] * 2, "reward_spec": {"verifier": "reverse"}, "group_size": 2}
    resp = rollout.post("/v1/rollouts", json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["job_id"]
    progress = wait_job(rollout, job_id, timeout_s=60)
    assert (progress["state"], progress["buffered"], progress["failed"]) == ("failed", 2, 0)
    assert (progress["unscored"], progress["unscored_samples"]) == (2, {"invalid_input": 4})
    assert progress["errors"] == {
        f"{job_id}-{i:06d}": "no sample scored (2 invalid_input): no target and none in the prompt"
        for i in range(2)
    }
    assert sample_sum("asyncrl_rollout_groups_unscored_total") - unscored_before == 2

    # one good prompt among bad ones: `done`, with the bad group counted and explained
    mixed = {
        "prompts": [{"input_ids": [BOS_ID]}, {"text": "abcd>"}],
        "reward_spec": {"verifier": "reverse"},
        "group_size": 2,
    }
    job_id = rollout.post("/v1/rollouts", json=mixed).json()["job_id"]
    progress = wait_job(rollout, job_id, timeout_s=60)
    assert (progress["state"], progress["buffered"], progress["unscored"], progress["failed"]) == (
        "done",
        2,
        1,
        0,
    )
    assert list(progress["errors"]) == [f"{job_id}-000000"]


def test_a_job_whose_every_group_the_engine_refused_reads_failed(rollout):
    # The rollout allows max_new_tokens up to ROLLOUT_CAP, the engine only ENGINE_CAP: the engine
    # answers 400 for every group (a misconfiguration the rollout cannot see at the door).
    body = {
        "prompts": [{"text": "abcd>"}, {"text": "bcde>"}],
        "reward_spec": {"verifier": "reverse"},
        "sampling_params": {"max_new_tokens": ENGINE_CAP + 1},
    }
    resp = rollout.post("/v1/rollouts", json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["job_id"]
    progress = wait_job(rollout, job_id, timeout_s=60)
    assert (progress["state"], progress["buffered"], progress["failed"], progress["trained"]) == (
        "failed",
        0,
        2,
        0,
    )
    assert sorted(progress["errors"]) == [f"{job_id}-000000", f"{job_id}-000001"]
    assert all(f"exceeds the cap {ENGINE_CAP}" in e for e in progress["errors"].values()), progress["errors"]
