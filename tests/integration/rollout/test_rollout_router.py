"""The rollout service behind the real `sglang-router` (pip `sglang_router`, CPU-only Rust
binary, subprocess) routing to two reference engines: generation goes through the router,
weight updates go to the workers (`engine_admin_urls`: the router does not forward
`/pause_generation` or `/update_weights_from_disk`), and the rollout's groups are complete,
scored, and versioned by the weights that produced them."""

from __future__ import annotations

import sys
import time

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_process, start_reward_service, wait_job
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.proto import RewardStatus, WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install sglang-router)")

torch.set_num_threads(1)

CONTEXT = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for version, seed in ((0, 0), (1, 1)):
        path = tmp_path_factory.mktemp(f"router_model_v{version}")
        build_tiny_model(path, seed=seed, max_position_embeddings=CONTEXT)
        out[version] = str(path)
    return out


@pytest.fixture(scope="module")
def topology(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_logs")
    engines = [serve_engine(models[0], max_running_requests=16, context_length=CONTEXT) for _ in range(2)]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *(e.url for e in engines),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        # its Prometheus exporter binds a fixed port by default: take a free one
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    router = start_process(cmd, f"http://127.0.0.1:{port}", "/health", log_path=logs / "router.log")
    reward = start_reward_service(log_path=logs / "reward.log")
    yield engines, router, reward
    reward.stop()
    router.stop()
    for e in engines:
        e.stop()


def test_rollout_behind_sglang_router(topology, models, redis_url, run_id):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engines, router, reward = topology
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=16, max_staleness=1)
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    running = serve_in_thread(
        redis_url,
        loaded_tokenizer=tokenizer,
        run=run_id,
        replica="r0",
        engine_urls=router.url,
        engine_admin_urls=",".join(e.url for e in engines),
        reward_url=reward.url,
        tokenizer=models[0],
        max_new_tokens_cap=64,
        default_max_new_tokens=8,
        claim_poll_s=0.05,
        weights_poll_s=0.5,
    )
    body = {
        "prompts": [
            {"text": f"{w}>"} for w in ("abcd", "bcde", "cdef", "defg", "efgh", "fghi", "ghij", "hija")
        ],
        "group_size": 2,
        "reward_spec": {"verifier": "reverse"},
    }
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            # The rollout service coalesces groups with the same sampling params into one
            # /generate; jobs with four different temperatures make at least four requests,
            # so round-robin must hand work to both engines.
            jobs = []
            for k, temperature in enumerate((1.0, 0.9, 0.8, 0.7)):
                job = {**body, "prompts": body["prompts"][2 * k : 2 * k + 2],
                       "sampling_params": {"temperature": temperature, "max_new_tokens": 8}}  # fmt: skip
                resp = client.post("/v1/rollouts", json=job)
                assert resp.status_code == 202, resp.text
                jobs.append(resp.json()["job_id"])
            for job_id in jobs:
                progress = wait_job(client, job_id)
                assert progress["buffered"] == 2, progress
            served = [e.engine.scheduler.stats["generated_tokens"] for e in engines]
            assert all(n > 0 for n in served), f"the router sent no work to one engine: {served}"

            PolicyVersions(buf).publish(
                WeightsInfo(version=1, method="disk", path=models[1], published_at=time.time())
            )
            wait_until(
                lambda: all(
                    httpx.get(f"{e.url}/get_model_info").json()["weight_version"] == "1" for e in engines
                ),
                timeout=30,
                message="the engines behind the router are updated",
            )
            second = client.post("/v1/rollouts", json={**body, "prompts": body["prompts"][:4]})
            assert wait_job(client, second.json()["job_id"])["buffered"] == 4
    finally:
        running.stop()

    groups = Groups(buf).take(12, current_version=1, max_staleness=1, block_ms=2000).groups
    assert len(groups) == 12
    v1 = AutoModelForCausalLM.from_pretrained(models[1]).eval()
    for g in groups:
        version = 0 if g.job_id in jobs else 1
        for s in g.samples:
            assert s.reward_status is RewardStatus.scored
            assert s.versions.tolist() == [version] * len(s.completion_ids)
            if version == 1:  # the tokens really came from the new weights
                prompt, tokens = g.prompt_tokens.tolist(), s.completion_ids.tolist()
                with torch.no_grad():
                    logits = v1(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
                want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
                got = torch.from_numpy(s.behavior_logprobs.astype(np.float32))
                assert torch.allclose(got, want, atol=1e-4)
