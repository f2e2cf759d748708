"""Episodes end to end on loopback: real Redis, the reference engine (tiny Qwen2,
character tokenizer), the real reward service serving the `secret` environment, the rollout
service driving multi-turn episodes. Nothing is mocked; the "failing environment" is a real
HTTP server that answers 500 on purpose (fault injection).

Covers: token-in/token-out (every policy token's behaviour logprob is the model's own logprob
of it in the full context, observations included; observation tokens are exactly the
environment's answer, tokenised, with loss mask 0 and logprob 0); rewards computed by hand from
the secret; the no-tool baseline is one turn; a weight update in the middle of turn 2 gives
tokens whose versions change inside the turn, each logprob matching its version's weights; an
environment that keeps failing fails the group, counted.
"""

from __future__ import annotations

import json
import random
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_reward_service, wait_job
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.proto import WeightsInfo
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 256
LETTERS = "abcdefghij"
EPISODE = {"environment": "secret", "max_turns": 2, "tool_format": "tagged", "tool_open": "?", "tool_close": "",
           "default_tool": "lookup", "observation_template": "{observation}=",
           "env_args": {"letters": LETTERS, "length": 3}}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("episode_model_v0")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


@pytest.fixture(scope="module")
def model_dir_v1(tmp_path_factory):
    path = tmp_path_factory.mktemp("episode_model_v1")
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


def settings(engine_url: str, reward_url: str, model_dir: str, run: str, **extra) -> dict:
    return {"run": run, "replica": "r0", "engine_urls": engine_url, "reward_url": reward_url, "tokenizer": model_dir,
            "max_new_tokens_cap": 100, "default_max_new_tokens": 8, "heartbeat_s": 0.3, "claim_poll_s": 0.05,
            "admission_poll_s": 0.05, "weights_poll_s": 0.5, "engine_backoff_s": 0.05, "env_retries": 1, **extra}  # fmt: skip


def secret_of(group_id: str, index: int) -> str:
    """The word the `secret` environment picks for an episode: the rollout seeds it with
    crc32 of the episode id; the environment draws with random.Random(seed)."""
    rng = random.Random(zlib.crc32(f"{group_id}/{index}".encode()))
    return "".join(rng.choice(LETTERS) for _ in range(3))


def take(redis_url: str, run_id: str, n: int) -> list:
    buf = Buffer(redis_url, run_id)
    return Groups(buf, "test-trainer").take(n, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                            block_ms=2000).groups  # fmt: skip


def model_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).numpy()


def test_episodes_keep_tokens_as_sampled_and_mask_observations(
    redis_url, run_id, reward, model_dir, tokenizer
):
    from transformers import AutoModelForCausalLM

    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    question, eq = tokenizer.convert_tokens_to_ids(["?", "="])
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            before = episode_counts(client.get("/metrics").text)
            params = {
                "max_new_tokens": 8,
                "ignore_eos": True,
                "skip_special_tokens": False,
                "temperature": 1.0,
            }
            tools = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>ab>"}] * 4, "group_size": 8,
                                                      "sampling_params": params, "episode": EPISODE})  # fmt: skip
            baseline = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>ab>"}] * 2, "group_size": 8,
                                                         "sampling_params": params,
                                                         "episode": {**EPISODE, "tools": False}})  # fmt: skip
            assert tools.status_code == 202 and baseline.status_code == 202, (tools.text, baseline.text)
            done = wait_job(client, tools.json()["job_id"])
            assert done["buffered"] == 4, done["errors"]
            assert wait_job(client, baseline.json()["job_id"])["buffered"] == 2
            unknown = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>>"}], "sampling_params": params,
                                                        "episode": {**EPISODE, "environment": "nope"}})  # fmt: skip
            assert unknown.status_code == 400 and "unknown environment" in unknown.text
            after = episode_counts(client.get("/metrics").text)
        groups = take(redis_url, run_id, 6)
    finally:
        running.stop()
        engine.stop()
    assert len(groups) == 6
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    called = 0
    for g in groups:
        prompt, s = g.prompt_tokens.tolist(), g.samples
        with_tools = g.job_id == tools.json()["job_id"]
        for i, sample in enumerate(s):
            ids, mask, lps = (
                sample.completion_ids.tolist(),
                sample.loss_mask.tolist(),
                sample.behavior_logprobs,
            )
            assert len(mask) == len(ids) and sample.turn_starts[0] == 0
            # token-in/token-out: every policy token is the model's own sample in the full context
            mine = [t for t in range(len(ids)) if mask[t]]
            want = model_logprobs(model, prompt, ids)
            np.testing.assert_allclose(lps[mine], want[mine], atol=1e-4)
            secret = secret_of(g.group_id, i)
            turn1 = ids[: sample.turn_starts[1]] if len(sample.turn_starts) > 1 else ids
            if with_tools and len(sample.turn_starts) == 2:  # turn 1 called the tool with `?`
                called += 1
                obs = tokenizer(secret + "=", add_special_tokens=False)["input_ids"]
                k = len(turn1) - len(obs)
                assert turn1[k - 1] == question and ids[k : sample.turn_starts[1]] == obs
                assert mask == [1] * k + [0] * len(obs) + [1] * (len(ids) - k - len(obs))
                assert lps[k : k + len(obs)].tolist() == [0.0] * len(obs)
                answer = ids[sample.turn_starts[1] :]
            else:
                assert sample.turn_starts == [0] and mask == [1] * len(ids)
                if with_tools:
                    assert question not in ids  # no call: turn 1 was the answer
                answer = ids
            text = tokenizer.decode(answer, skip_special_tokens=False)
            want_reward = sum(a == b for a, b in zip(text, secret)) / 3
            if with_tools and len(sample.turn_starts) == 2 and answer[-1] == question:
                want_reward = 0.0  # a call on the last turn: no answer
            assert sample.reward == pytest.approx(want_reward) and sample.reward_status.value == "scored"
            assert sample.turn_rewards[-1] == pytest.approx(want_reward)
    assert called > 0, (
        "no episode called the tool: the test model should sample `?` within 8 tokens now and then"
    )
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sum(v for k, v in delta.items() if k.startswith("episodes")) == 6 * 8  # answered, or out of turns
    assert delta.get('tool_calls{result="called"}', 0) >= called


def episode_counts(metrics: str) -> dict[str, float]:
    """The rollout's episode and tool-call counters (process-wide: compare before and after)."""
    out = {}
    for line in metrics.splitlines():
        for name in ("episodes", "tool_calls"):
            prefix = f"asyncrl_rollout_{name}_total"
            if line.startswith(prefix):
                key, value = line[len(prefix) :].rsplit(" ", 1)
                out[name + key] = float(value)
    return out


def test_weight_update_in_the_middle_of_turn_two(
    redis_url, run_id, reward, model_dir, model_dir_v1, tokenizer
):
    """Freeze the engine while turn-2 requests (their prompt holds an observation) decode, publish
    version 1: they are aborted and resubmitted with their prefix; turn 2's tokens switch
    version inside the turn, each logprob the one its version's weights give."""
    from transformers import AutoModelForCausalLM

    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=8, max_staleness=1)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    question, eq = tokenizer.convert_tokens_to_ids(["?", "="])

    def turn_two_under_way() -> bool:
        reqs = list(engine.engine.scheduler.running)
        return any(eq in r.prompt_ids and len(r.output_ids) >= 4 for r in reqs)

    try:
        with (
            httpx.Client(base_url=running.url, timeout=30) as client,
            httpx.Client(base_url=engine.url) as eng,
        ):
            params = {
                "max_new_tokens": 60,
                "ignore_eos": True,
                "skip_special_tokens": False,
                "temperature": 1.0,
            }
            job = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>ab>"}] * 4, "group_size": 16,
                                                    "sampling_params": params, "episode": EPISODE}).json()  # fmt: skip
            wait_until(turn_two_under_way, timeout=60, interval=0.002, message="a turn 2 decodes")
            assert eng.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            PolicyVersions(buf).publish(
                WeightsInfo(version=1, method="disk", path=model_dir_v1, published_at=time.time())
            )
            done = wait_job(client, job["job_id"])
            assert done["buffered"] == 4, done["errors"]
        groups = take(redis_url, run_id, 4)
    finally:
        running.stop()
        engine.stop()
    models = {
        v: AutoModelForCausalLM.from_pretrained(d).eval() for v, d in ((0, model_dir), (1, model_dir_v1))
    }
    switched_in_turn_two = 0
    for g in groups:
        prompt = g.prompt_tokens.tolist()
        for sample in g.samples:
            ids, versions, mask = (
                sample.completion_ids.tolist(),
                sample.versions.tolist(),
                sample.loss_mask.tolist(),
            )
            mine = np.array([t for t in range(len(ids)) if mask[t]])
            policy_versions = [versions[t] for t in mine]
            assert policy_versions == sorted(policy_versions)  # old tokens first, then new ones
            for v, model in models.items():
                at = np.array([t for t in mine if versions[t] == v], dtype=int)
                if len(at):
                    np.testing.assert_allclose(sample.behavior_logprobs[at], model_logprobs(model, prompt, ids)[at],
                                               atol=1e-4)  # fmt: skip
            if len(sample.turn_starts) == 2:
                turn2 = versions[sample.turn_starts[1] :]
                switched_in_turn_two += 0 in turn2 and 1 in turn2
        assert g.min_version == min(v for s in g.samples for v, m_ in zip(s.versions, s.loss_mask) if m_)
    assert switched_in_turn_two > 0


class _FailingEnvironments(BaseHTTPRequestHandler):
    """Lists a `secret` environment that judges, and answers every reset with HTTP 500."""

    def do_GET(self):
        body = json.dumps({"environments": {"secret": {"judges": True}}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(500)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_environment_that_keeps_failing_fails_the_group_counted(
    redis_url, run_id, reward, model_dir, tokenizer
):
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _FailingEnvironments)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = serve_engine(model_dir, max_running_requests=16, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **settings(engine.url, reward.url, model_dir, run_id,
                                         environments_url=f"http://127.0.0.1:{server.server_port}"))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            job = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>>"}], "group_size": 2,
                                                    "sampling_params": {"max_new_tokens": 3},
                                                    "episode": {**EPISODE, "retries": 1}}).json()  # fmt: skip
            progress = wait_job(client, job["job_id"])
            metrics = client.get("/metrics").text
    finally:
        running.stop()
        engine.stop()
        server.shutdown()
    assert progress["failed"] == 1 and progress["buffered"] == 0
    assert "environment 'secret' failed 2 times" in next(iter(progress["errors"].values()))
    # each failed attempt counted by kind: both of the failing episode's, and up to both of the
    # other's (cancelled when the first fails its group)
    retries = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('asyncrl_rollout_episode_retries_total{kind="unavailable"}')]  # fmt: skip
    assert retries and 2 <= retries[0] <= 4


def test_a_failing_tool_is_an_observation_and_a_verifier_scores_the_answer(redis_url, run_id, reward, model_dir,
                                                                           tokenizer):  # fmt: skip
    """`calculator` with the tagged call `?` (no expression): every call fails as a tool
    (`tool_error`), the error goes back to the policy as an observation (loss mask 0) and the
    episode goes on; the environment does not judge, so the `reverse` verifier scores the
    final answer."""
    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, **settings(engine.url, reward.url, model_dir, run_id)
    )
    episode = {**EPISODE, "environment": "calculator", "default_tool": "calculator", "env_args": {}}
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            refused = client.post(
                "/v1/rollouts", json={"prompts": [{"text": "<bos>ab>"}], "episode": episode}
            )
            assert refused.status_code == 400 and "does not judge" in refused.text
            job = client.post("/v1/rollouts", json={"prompts": [{"text": "<bos>ab>"}] * 2, "group_size": 16,
                                                    "reward_spec": {"verifier": "reverse", "target": "ab"},
                                                    "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
                                                    "episode": episode}).json()  # fmt: skip
            assert wait_job(client, job["job_id"])["buffered"] == 2
            with httpx.Client(base_url=reward.url) as rw:
                steps = [line for line in rw.get("/metrics").text.splitlines()
                         if line.startswith('asyncrl_reward_env_steps_total{environment="calculator",status="tool_error"}')]  # fmt: skip
        groups = take(redis_url, run_id, 2)
    finally:
        running.stop()
        engine.stop()
    called, obs_marker = 0, tokenizer.convert_tokens_to_ids("?")
    for g in groups:
        for s in g.samples:
            ids, mask = s.completion_ids.tolist(), s.loss_mask.tolist()
            if len(s.turn_starts) == 2:
                called += 1
                obs = [t for t in range(s.turn_starts[1]) if not mask[t]]
                assert obs and ids[obs[0] - 1] == tokenizer.convert_tokens_to_ids("?")
                assert tokenizer.decode([ids[t] for t in obs]).endswith("=")  # the template around the error
                last = ids[s.turn_starts[1] :]
                # (a call on the last turn leaves no answer)
                answer = "" if last[-1] == obs_marker else tokenizer.decode(last, skip_special_tokens=True)
            else:
                answer = tokenizer.decode(ids, skip_special_tokens=True)
            want = sum(a == b for a, b in zip(answer, "ab")) / max(len(answer), 2)
            assert s.reward_status.value == "scored" and s.reward == pytest.approx(want)
    assert called > 0 and steps and float(steps[0].rsplit(" ", 1)[1]) >= called
