"""An OpenEnv env server, made with the real openenv-core 0.3.0 (`openenv init`, in a venv of its
own) and started with uvicorn as its README says, driven by episode jobs of the real rollout
service on loopback: real Redis, the reference engine (tiny Qwen2, character tokenizer).

The env is the scaffold with its environment and models rewritten the way a user would: a
counter whose state lives in the server's session (each step's observation says how many steps
the session has seen), whose reward depends on the action and the count, and which is done at
the second step. It logs every reset and action it receives to a file, so the test compares
what the server got with what the policy's tokens say it called.

Covers: the action sent is the parsed call; the observation enters the context (loss mask 0)
as the template says; reward = the env's; done ends the episode; the task (the reset
observation) is a user message of the chat template; the server's max_concurrent_envs is kept;
a server killed mid-episode and started again restarts episodes from reset, counted; a server
error fails the group with its message, counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_reward_service, wait_job
from thirdparty import thirdparty_venv
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.services.ops.tinymodel import build_tiny_model

# `make test-extended` (.ci/run's second stage): builds openenv-core's venv
pytestmark = pytest.mark.extended

torch.set_num_threads(1)

CONTEXT = 512
TASK = "say something"
MESSAGES = [{"role": "user", "content": "ab"}]
# The call: the text between the turn's last `a` and the `g` that ends the turn (a one-token
# marker stops the turn). The random tiny model, sampled with top_k 5, writes each about one
# token in ten, so about half the turns call; a turn with an `a` and no `g` leaves its call open
# (an invalid_call, not sent); one with a `g` and no `a` is a final answer.
OPEN, CLOSE = "a", "g"
EPISODE = {"environment": "counter", "kind": "openenv", "max_turns": 4, "tool_format": "tagged",
           "tool_open": OPEN, "tool_close": CLOSE, "observation_template": "{observation}="}  # fmt: skip
PARAMS = {
    "max_new_tokens": 40,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "temperature": 1.0,
    "top_k": 5,
}

MODELS = """
from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class CounterAction(Action):
    message: str = Field(..., description="what to say")


class CounterObservation(Observation):
    text: str = Field(default="", description="the step count and what was said")
"""

ENVIRONMENT = """
import json
import os
import threading

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import CounterAction, CounterObservation
except ImportError:
    from models import CounterAction, CounterObservation

_LOG = threading.Lock()


def log(record):
    with _LOG, open(os.environ["COUNTER_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class CounterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, explode=False, **kwargs) -> CounterObservation:
        if explode:
            raise RuntimeError("the counter exploded")
        self._state = State(episode_id=episode_id, step_count=0)
        log({"reset": episode_id, "seed": seed, "pid": os.getpid()})
        return CounterObservation(text="say something", done=False, reward=None)

    def step(self, action: CounterAction) -> CounterObservation:
        self._state.step_count += 1
        count = self._state.step_count
        log({"episode": self._state.episode_id, "message": action.message, "count": count, "pid": os.getpid()})
        return CounterObservation(
            text=f"{count}:{action.message}", done=count >= 2, reward=len(action.message) / 10 + count
        )

    @property
    def state(self) -> State:
        return self._state
"""


@pytest.fixture(scope="module")
def openenv_python():
    return thirdparty_venv("openenv", ["openenv-core==0.3.0"])


@pytest.fixture(scope="module")
def counter_dir(openenv_python, tmp_path_factory):
    """`openenv init counter`, then the echo scaffold's models and environment replaced."""
    root = tmp_path_factory.mktemp("openenv")
    openenv = Path(openenv_python).parent / "openenv"
    subprocess.run([str(openenv), "init", "counter", "--output-dir", str(root)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    env_dir = root / "counter"
    (env_dir / "models.py").write_text(textwrap.dedent(MODELS))
    (env_dir / "server" / "counter_environment.py").write_text(textwrap.dedent(ENVIRONMENT))
    assert "max_concurrent_envs=1" in (env_dir / "server" / "app.py").read_text()  # the scaffold's
    return env_dir


class CounterServer:
    """`uvicorn server.app:app` in the env's directory, as the scaffold's README runs it."""

    def __init__(self, python: Path, env_dir: Path, log: Path, workers: int = 1):
        self.python, self.env_dir, self.log, self.workers = python, env_dir, log, workers
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> CounterServer:
        self.proc = subprocess.Popen(
            [
                str(self.python),
                "-m",
                "uvicorn",
                "server.app:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                str(self.workers),
            ],
            cwd=self.env_dir,
            env={**os.environ, "COUNTER_LOG": str(self.log), "ENABLE_WEB_INTERFACE": "false"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(self._up, timeout=120, interval=0.2, message="the OpenEnv server answers /health")
        except BaseException:
            self.kill()
            raise
        return self

    def _up(self) -> bool:
        assert self.proc.poll() is None, "the OpenEnv server exited"
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGTERM (uvicorn's supervisor then stops its workers), SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("openenv_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
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


def rollout_settings(
    engine_url: str, reward_url: str, model_dir: str, run: str, port: int, scheme: str = "ws"
) -> dict:
    return {"run": run, "replica": "r0", "engine_urls": engine_url, "reward_url": reward_url,
            "tokenizer": model_dir, "max_new_tokens_cap": 100, "default_max_new_tokens": 8, "heartbeat_s": 0.3, "claim_poll_s": 0.05,
            "admission_poll_s": 0.05, "weights_poll_s": 0.5, "engine_backoff_s": 0.05,
            "openenv": {"counter": {"url": f"{scheme}://127.0.0.1:{port}", "max_sessions": 1}}}  # fmt: skip


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_session(log: list[dict], episode_id: str) -> list[dict]:
    """The steps the server saw in the episode's last session (after its last reset)."""
    start = max(i for i, r in enumerate(log) if r.get("reset") == episode_id)
    return [r for r in log[start + 1 :] if r.get("episode") == episode_id]


def metric(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def check_episode(tokenizer, prompt: list[int], sample, steps: list[dict] | None) -> list[str]:
    """What the runner guarantees of one finished episode, against what the server saw in its
    session (`steps`; None: over HTTP, where every step meets a fresh environment whose count
    is 1); the messages it sent."""
    counts = (lambda n: [1] * n) if steps is None else (lambda n: list(range(1, n + 1)))
    ids, mask = sample.completion_ids.tolist(), sample.loss_mask.tolist()
    task = tokenizer(f"user: {TASK}\nassistant: ", add_special_tokens=False)["input_ids"]
    # the task is a user message of the chat template, after the chat rendered without its generation prompt
    rendered = tokenizer.apply_chat_template(MESSAGES + [{"role": "user", "content": TASK}],
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert prompt + ids[: len(task)] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert mask[: len(task)] == [0] * len(task) and sample.turn_starts[0] == len(task)
    starts = [*sample.turn_starts, len(ids)]
    stepped = []  # the calls the runner must have sent: those before the last allowed turn
    for k, (start, end) in enumerate(zip(starts, starts[1:])):
        policy = [t for t in range(start, end) if mask[t]]
        text = tokenizer.decode([ids[t] for t in policy], skip_special_tokens=False)
        opened = text.rfind(OPEN)
        rest = text[opened + len(OPEN) :]
        if opened < 0 or CLOSE not in rest or k == EPISODE["max_turns"] - 1:
            continue  # a final answer, a call left open, or a call on the last turn (nothing answers it)
        stepped.append(rest[: rest.index(CLOSE)].strip())
        if k + 1 < len(sample.turn_starts):  # not done: the observation follows the call, loss mask 0
            obs = tokenizer(f"{counts(len(stepped))[-1]}:{stepped[-1]}=", add_special_tokens=False)[
                "input_ids"
            ]
            after = policy[-1] + 1
            assert ids[after : after + len(obs)] == obs and mask[after : after + len(obs)] == [0] * len(obs)
    if steps is None:  # stateless: never done, as the count never reaches 2
        steps = [{"message": m, "count": 1} for m in stepped]
    # the action sent is the parsed call, in one session (its count goes on from step to step)
    assert [s["message"] for s in steps] == stepped
    assert [s["count"] for s in steps] == counts(len(steps))
    if (
        len(steps) == 2 and counts(2)[-1] == 2
    ):  # the second step is done: the episode ends on the call, nothing after it
        assert len(sample.turn_starts) == 2 and mask[-1] == 1
    want = sum(len(m) / 10 + count for count, m in zip(counts(len(stepped)), stepped))
    assert sample.reward == pytest.approx(want) and sample.reward_status.value == "scored"
    assert sample.reward_details["actions"] == [{"message": m} for m in stepped]
    return stepped


def test_an_openenv_server_driven_by_episode_jobs(redis_url, run_id, reward, openenv_python, counter_dir,
                                                   model_dir, tokenizer, tmp_path):  # fmt: skip
    log = tmp_path / "counter.jsonl"
    server = CounterServer(openenv_python, counter_dir, log).start()
    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **rollout_settings(engine.url, reward.url, model_dir, run_id, server.port))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            unknown = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}],
                                                        "episode": {**EPISODE, "environment": "ws://10.0.0.1:80"}})  # fmt: skip
            assert unknown.status_code == 400 and "unknown OpenEnv server" in unknown.text
            job = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}] * 3, "group_size": 8,
                                                    "sampling_params": PARAMS, "episode": EPISODE})  # fmt: skip
            assert job.status_code == 202, job.text
            done = wait_job(client, job.json()["job_id"], timeout_s=600)
            assert done["buffered"] == 3, done["errors"]
            exploded = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}], "group_size": 2,
                                                         "sampling_params": PARAMS,
                                                         "episode": {**EPISODE, "env_args": {"explode": True}}})  # fmt: skip
            failed = wait_job(client, exploded.json()["job_id"], timeout_s=120)
            metrics = client.get("/metrics").text
        buf = Buffer(redis_url, run_id)
        groups = Groups(buf, "t").take(3, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                       block_ms=2000).groups  # fmt: skip
    finally:
        running.stop()
        engine.stop()
        server.kill()
    # a server error is the episode's failure, with the server's message, counted, never retried
    assert failed["failed"] == 1 and "the counter exploded" in next(iter(failed["errors"].values()))
    assert metric(metrics, 'asyncrl_rollout_openenv_errors_total{kind="server_error",server="counter"}') >= 1
    records = read_log(log)
    assert len(groups) == 3
    steps_made = 0
    for g in groups:
        for i, sample in enumerate(g.samples):
            steps_made += len(check_episode(tokenizer, g.prompt_tokens.tolist(), sample,
                                        last_session(records, f"{g.group_id}/{i}")))  # fmt: skip
    assert steps_made > 0, "no episode called the tool: the test model should write `a…g` often"
    assert metric(metrics, 'asyncrl_rollout_env_steps_total{environment="counter",status="ok"}') >= steps_made


def test_a_server_process_killed_mid_episode_restarts_its_episodes(redis_url, run_id, reward, openenv_python,
                                                                   counter_dir, model_dir, tokenizer, tmp_path):  # fmt: skip
    """uvicorn with two worker processes; SIGKILL the worker that made the first step, mid-episode:
    that episode's socket drops, and the episode starts again from reset in a new session (on
    the other worker), counted by kind; the group still completes, each episode's actions those
    of its last session."""
    log = tmp_path / "counter.jsonl"
    server = CounterServer(openenv_python, counter_dir, log, workers=2).start()
    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **rollout_settings(engine.url, reward.url, model_dir, run_id, server.port))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            before = client.get("/metrics").text
            job = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}] * 2, "group_size": 8,
                                                    "sampling_params": PARAMS,
                                                    "episode": {**EPISODE, "retries": 5}})  # fmt: skip
            assert job.status_code == 202, job.text
            wait_until(lambda: any("episode" in r for r in read_log(log)), timeout=300, interval=0.005,
                       message="the server made a step")  # fmt: skip
            first = next(r for r in read_log(log) if "episode" in r)
            os.kill(first["pid"], signal.SIGKILL)  # the worker holding that episode's session
            killed_at = len(read_log(log))
            done = wait_job(client, job.json()["job_id"], timeout_s=600)
            after = client.get("/metrics").text
        buf = Buffer(redis_url, run_id)
        groups = Groups(buf, "t").take(2, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                       block_ms=2000).groups  # fmt: skip
    finally:
        running.stop()
        engine.stop()
        server.kill()
    assert done["buffered"] == 2, done["errors"]

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew('asyncrl_rollout_episode_retries_total{kind="dropped"}') >= 1
    assert grew('asyncrl_rollout_openenv_errors_total{kind="dropped",server="counter"}') >= 1
    records = read_log(log)
    by_id = {f"{g.group_id}/{i}": (g, s) for g in groups for i, s in enumerate(g.samples)}
    _, dropped = by_id[first["episode"]]
    assert dropped.reward_details["attempt"] >= 1  # the killed episode was started again, from reset
    assert any(r.get("reset") == first["episode"] and r["pid"] != first["pid"] for r in records[killed_at:])
    for episode_id, (g, sample) in by_id.items():
        check_episode(tokenizer, g.prompt_tokens.tolist(), sample, last_session(records, episode_id))


def test_an_openenv_server_over_http_is_stateless(redis_url, run_id, reward, openenv_python, counter_dir,
                                                  model_dir, tokenizer, tmp_path):  # fmt: skip
    """The same server named by its http:// URL: episodes go over POST /reset and /step, each of
    which builds a fresh environment (OpenEnv's HTTP routes), so every step's count is 1."""
    log = tmp_path / "counter.jsonl"
    server = CounterServer(openenv_python, counter_dir, log).start()
    engine = serve_engine(model_dir, max_running_requests=64, max_new_tokens_cap=100, context_length=CONTEXT)
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tokenizer,
                              **rollout_settings(engine.url, reward.url, model_dir, run_id, server.port, "http"))  # fmt: skip
    try:
        with httpx.Client(base_url=running.url, timeout=30) as client:
            job = client.post("/v1/rollouts", json={"prompts": [{"messages": MESSAGES}] * 2, "group_size": 8,
                                                    "sampling_params": PARAMS, "episode": EPISODE})  # fmt: skip
            assert job.status_code == 202, job.text
            done = wait_job(client, job.json()["job_id"], timeout_s=600)
            assert done["buffered"] == 2, done["errors"]
        buf = Buffer(redis_url, run_id)
        groups = Groups(buf, "t").take(2, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                       block_ms=2000).groups  # fmt: skip
    finally:
        running.stop()
        engine.stop()
        server.kill()
    sent = [
        m
        for g in groups
        for s in g.samples
        for m in check_episode(tokenizer, g.prompt_tokens.tolist(), s, None)
    ]
    steps = [r for r in read_log(log) if "message" in r]
    assert sent and sorted(r["message"] for r in steps) == sorted(sent)
    assert {r["count"] for r in steps} == {1} and {r["episode"] for r in steps} == {None}
