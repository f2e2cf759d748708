"""The environment's first observation (the task) enters an episode as a user message of the
chat template, for asyncrl's own environment protocol (proto/environments.py): real Redis, the
reference engine (tiny Qwen2, whose tokenizer has a chat template), the real reward service for
the verifier list, and a real HTTP server on loopback that speaks the protocol (an environment
of the user's, written here with the protocol's own models) and whose reset says the task.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_reward_service, wait_job

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.proto.environments import ResetResponse, ResetResults, StepBatch, StepResponse, StepResults
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 256
TASK = "find x"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
ANSWERS: list[str] = []  # the final answers the environment was sent


class _QuizEnvironment(BaseHTTPRequestHandler):
    """`quiz`: its reset says the task; the answer earns a tenth per character."""

    def do_GET(self):
        self._send({"environments": {"quiz": {"judges": True}}})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path.endswith("/reset_batch"):
            n = len(json.loads(body)["items"])
            self._send(ResetResults(results=[ResetResponse(observation=TASK)] * n).model_dump())
            return
        items = StepBatch.model_validate_json(body).items
        ANSWERS.extend(item.action.text for item in items)
        results = [StepResponse(reward=len(item.action.text) / 10, done=True) for item in items]
        self._send(StepResults(results=results).model_dump())

    def _send(self, value: dict) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("task_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


def test_the_reset_observation_is_a_user_message_of_the_chat_template(redis_url, run_id, model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    env = ThreadingHTTPServer(("127.0.0.1", free_port()), _QuizEnvironment)
    threading.Thread(target=env.serve_forever, daemon=True).start()
    reward = start_reward_service(log_path=tmp_path / "reward.log")
    engine = serve_engine(model_dir, max_running_requests=16, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=8, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tok, run=run_id, replica="r0", engine_urls=engine.url,
                              reward_url=reward.url, tokenizer=model_dir, max_new_tokens_cap=100,
                              default_max_new_tokens=8, heartbeat_s=0.3, claim_poll_s=0.05, admission_poll_s=0.05,
                              environments_url=f"http://127.0.0.1:{env.server_port}")  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            job = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}], "group_size": 4,
                                                    "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
                                                    "episode": {"environment": "quiz", "tools": False}})  # fmt: skip
            assert job.status_code == 202, job.text
            assert wait_job(client, job.json()["job_id"])["buffered"] == 1
        buf = Buffer(redis_url, run_id)
        (group,) = Groups(buf, "t").take(1, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                         block_ms=2000).groups  # fmt: skip
    finally:
        running.stop()
        engine.stop()
        reward.stop()
        env.shutdown()
    prompt = group.prompt_tokens.tolist()
    # the prompt: the chat without the generation prompt
    assert (
        prompt
        == tok(tok.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    rendered = tok.apply_chat_template(MESSAGES + [{"role": "user", "content": TASK}], add_generation_prompt=True,
                                       tokenize=False)  # fmt: skip
    with_task = tok(rendered, add_special_tokens=False)["input_ids"]
    task = with_task[len(prompt) :]
    assert tok.decode(task) == f"user: {TASK}\nassistant: "
    for sample in group.samples:
        ids, mask = sample.completion_ids.tolist(), sample.loss_mask.tolist()
        assert prompt + ids[: len(task)] == with_task  # the task as the template's user message
        assert mask == [0] * len(task) + [1] * (len(ids) - len(task)) and sample.turn_starts == [len(task)]
        answer = tok.decode(ids[len(task) :], skip_special_tokens=True)
        assert answer in ANSWERS and sample.reward == pytest.approx(len(answer) / 10)
