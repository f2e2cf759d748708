"""`asyncrl submit --reasoning-gym` against a live rollout service: real Redis (fixture), the
reference engine (uvicorn thread, tiny Qwen2 with room for reasoning-gym's system prompt), the
real reward service (`asyncrl reward --reasoning-gym-enabled`, a subprocess with its worker
processes) and the rollout service over HTTP.

The jobs it makes are checked against entries the test generates itself with reasoning-gym:
one group per entry, the entry's question after reasoning-gym's system prompt, a spec naming
the entry, and every sample's reward equal to the dataset's own score of its completion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import reasoning_gym
import torch
from engine_server import serve_in_thread as serve_engine
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
from rollout_server import serve_in_thread, start_reward_service, wait_job

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.proto.reasoning_gym import entry_digest
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 1024  # the default system prompt (~480 characters) and a question, one token a character
CAP = 16
DATASET, SIZE, SEED = "basic_arithmetic", 3, 11


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rgym_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_engine(model_dir, max_running_requests=16, max_new_tokens_cap=CAP, context_length=CONTEXT)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(
        log_path=tmp_path_factory.mktemp("reward") / "reward.log",
        args=("--reasoning-gym-enabled", "--reasoning-gym-workers", "1", "--math-workers", "1"),
    )
    yield running
    running.stop()


@pytest.fixture
def rollout(redis_url, run_id, engine, reward, model_dir, tokenizer):
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=16, max_staleness=0)
    running = serve_in_thread(
        redis_url,
        loaded_tokenizer=tokenizer,
        run=run_id,
        replica="r0",
        engine_urls=engine.url,
        reward_url=reward.url,
        tokenizer=model_dir,
        max_new_tokens_cap=CAP,
        default_max_new_tokens=CAP,
        heartbeat_s=0.3,
        claim_poll_s=0.05,
        admission_poll_s=0.05,
    )
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield client
    running.stop()


def submit(url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "submit", *args, "--url", url]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)


def test_submit_builds_scored_jobs_from_a_reasoning_gym_dataset(rollout, redis_url, run_id):
    url = str(rollout.base_url)
    out = submit(url, "--reasoning-gym", DATASET, "--size", str(SIZE), "--seed", str(SEED),
                 "--group-size", "2", "--batch", "2", "--idempotency-key", "rg")  # fmt: skip
    assert out.returncode == 0, out.stderr
    jobs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [j["groups"] for j in jobs] == [2, 1]
    for job in jobs:
        assert wait_job(rollout, job["job_id"], timeout_s=120)["buffered"] == job["groups"]

    dataset = reasoning_gym.create_dataset(DATASET, seed=SEED, size=SIZE)
    buf = Buffer(redis_url, run_id)
    groups = Groups(buf, "test-trainer").take(SIZE, current_version=PolicyVersions(buf).version(),
                                              max_staleness=10**6, block_ms=5000).groups  # fmt: skip
    by_index = {g.reward_spec["index"]: g for g in groups}
    assert sorted(by_index) == list(range(SIZE))
    for index, group in by_index.items():
        entry = dataset[index]
        assert group.reward_spec == {
            "verifier": "reasoning_gym",
            "dataset": DATASET,
            "config": {"seed": SEED, "size": SIZE},
            "index": index,
            "entry_sha256": entry_digest(entry),
        }
        assert set(group.samples.prompt_id) == {f"rg-{DATASET}-{SEED}-{index}"}
        assert len(group.samples.text) == 2
        for text, reward, status in zip(
            group.samples.text, group.samples.reward, group.samples.reward_status
        ):
            assert (status, reward) == ("scored", dataset.score_answer(extract_answer(text), entry))

    # Re-running the same command submits nothing twice.
    again = submit(url, "--reasoning-gym", DATASET, "--size", str(SIZE), "--seed", str(SEED),
                   "--group-size", "2", "--batch", "2", "--idempotency-key", "rg")  # fmt: skip
    assert [json.loads(line)["duplicate"] for line in again.stdout.splitlines()] == [True, True]


def test_submit_refuses_unknown_datasets_and_configs(rollout):
    url = str(rollout.base_url)
    unknown = submit(url, "--reasoning-gym", "gsm_symbolc", "--size", "2")
    assert unknown.returncode == 1 and "unknown reasoning-gym 0.1.25 dataset 'gsm_symbolc'" in unknown.stderr
    bad_config = submit(url, "--reasoning-gym", DATASET, "--size", "2", "--config", '{"no_such_field": 1}')
    assert bad_config.returncode == 1 and "no_such_field" in bad_config.stderr
    # A spec posted by hand with an unknown dataset is refused by the rollout service itself.
    spec = {
        "verifier": "reasoning_gym",
        "dataset": "gsm_symbolc",
        "config": {"seed": 0, "size": 1},
        "index": 0,
    }
    reply = rollout.post("/v1/rollouts", json={"prompts": [{"text": "1+1=", "reward_spec": spec}]})
    assert reply.status_code == 422 and "unknown reasoning-gym 0.1.25 dataset" in reply.text


def test_the_prompt_is_reasoning_gyms_system_prompt_and_the_question():
    from asyncrl.services.rollout.submit import reasoning_gym_rows

    rows = reasoning_gym_rows(DATASET, SIZE, SEED)
    dataset = reasoning_gym.create_dataset(DATASET, seed=SEED, size=SIZE)
    assert [r["messages"] for r in rows] == [
        [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": dataset[i]["question"]},
        ]
        for i in range(SIZE)
    ]
    bare = reasoning_gym_rows(DATASET, 1, SEED, system_prompt=None, boxed_fallback=True)
    assert bare[0]["messages"] == [{"role": "user", "content": dataset[0]["question"]}]
    assert bare[0]["reward_spec"]["boxed_fallback"] is True
