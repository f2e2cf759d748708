"""A verifiers environment through the gateway, end to end: the real `vf-eval` (verifiers 0.4.0, in
a venv of its own), unmodified, run by `asyncrl verifiers` against the rollout service over
loopback, with real Redis, the reference engine (tiny Qwen2, uvicorn thread) and the buffer.

The environment is a package written into the test's tmp dir and found the way `vf-eval` finds
any environment (an importable module exporting its `Taskset`, here with its own `Harness`):
three tasks, a rubric of two reward functions of the completion text (its length's parity,
weight 1; whether it holds an "e", weight 0.5), and a harness that runs in-process (verifiers'
own "the interception is the contract" option) and makes one chat call through verifiers'
interception server, which relays it to the gateway with `X-Session-ID`. The built-in
harnesses need `uv` and the network to install their program, which this machine has not.
The first rollout of the last task asks for more tokens than the gateway's cap, so the gateway
refuses it, verifiers marks that rollout failed, and its whole group must fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from prometheus_client import REGISTRY
from rollout_server import serve_in_thread
from thirdparty import thirdparty_venv

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

CONTEXT = 256
CAP = 16
TASKS, ROLLOUTS = 3, 2
RUN = "vfrun1"

ENV_MODULE = r"""
import httpx
import verifiers.v1 as vf

ASKED = {}  # task idx -> rollouts started (in-process: one event loop, no races)


def answer(trace):
    return next(m.content for m in reversed(trace.messages) if m.role == "assistant")


class GwData(vf.TaskData):
    pass


class GwTask(vf.Task[GwData]):
    @vf.reward(weight=1.0)
    async def odd_length(self, trace: vf.Trace) -> float:
        return float(len(answer(trace)) % 2)

    @vf.reward(weight=0.5)
    async def has_e(self, trace: vf.Trace) -> float:
        return 1.0 if "e" in answer(trace) else 0.0


class GwConfig(vf.TasksetConfig):
    num_tasks: int = 3


class GwTaskset(vf.Taskset[GwTask, GwConfig]):
    def load(self):
        return [GwTask(GwData(prompt=f"Task {i}: tell me about the number {i}."))
                for i in range(self.config.num_tasks)]


class GwHarnessConfig(vf.HarnessConfig):
    pass


class GwHarness(vf.Harness[GwHarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        n = ASKED[data.idx] = ASKED.get(data.idx, 0) + 1
        # The last task's first rollout asks past the gateway's cap: refused (400).
        max_tokens = 10_000 if (data.idx == 2 and n == 1) else 12
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.post(
                endpoint.rstrip("/") + "/chat/completions",
                headers={"Authorization": f"Bearer {secret}"},
                json={"model": ctx.model, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": data.prompt}]},
            )
        return vf.ProgramResult(exit_code=0 if resp.status_code == 200 else 1,
                                stdout=resp.text, stderr=resp.text)


__all__ = ["GwTaskset", "GwHarness"]
"""


@pytest.fixture(scope="module")
def vf_python() -> Path:
    return thirdparty_venv("verifiers", ["verifiers==0.4.0"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf_gateway_model")
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


@pytest.fixture
def rollout(redis_url, run_id, engine, model_dir, tokenizer):
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    # No reward service: every reward here is the client's (verifiers'), none is asked for.
    running = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, run=run_id, replica="v0", engine_urls=engine.url,
        reward_url="http://127.0.0.1:9", tokenizer=model_dir, max_new_tokens_cap=CAP,
        default_max_new_tokens=8, weights_poll_s=0.5, engine_backoff_s=0.05,
    )  # fmt: skip
    yield running
    running.stop()


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def counts() -> dict[str, float]:
    return {
        **{
            f"group_{r}": metric("asyncrl_rollout_vf_groups_total", result=r)
            for r in ("buffered", "duplicate", "failed")
        },
        **{
            f"rollout_{r}": metric("asyncrl_rollout_vf_rollouts_failed_total", reason=r)
            for r in ("verifiers_error", "group_failed", "no_session", "missing")
        },
    }


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counts().items() if v != before[k]}


def run_vf_eval(vf_python: Path, url: str, tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    envs = tmp_path / "envs" / "vf_gw_env"
    envs.mkdir(parents=True)
    (envs / "__init__.py").write_text(ENV_MODULE)
    vf_eval = [str(vf_python.parent / "vf-eval"), "vf-gw-env", "-n", str(TASKS), "-r", str(ROLLOUTS)]
    vf_eval += ["--no-push", "--no-rich", "--env.agent.runtime.type", "subprocess", "--model", "tiny"]
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "verifiers", "--gateway", url, "--run", RUN]
    cmd += ["--output-dir", str(tmp_path / "out"), "--poll-s", "0.2", "--", *vf_eval]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "envs"), "HOME": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def verifiers_rollouts(traces: Path) -> dict[str, dict]:
    """Each trace of `traces.jsonl` as verifiers wrote it: task, ok, answer, its reward (Σ score×weight)."""
    out = {}
    for line in traces.read_text().splitlines():
        episode = json.loads(line)
        [trace] = episode["traces"]
        answers = [n["message"]["content"] for n in trace["nodes"] if n["message"]["role"] == "assistant"]
        rewards = trace.get("rewards") or {}
        out[trace["id"]] = {
            "task": trace["task"]["data"]["idx"],
            "ok": trace["ok"],
            "answer": answers[-1] if answers else None,
            "reward": sum(r["score"] * r["weight"] for r in rewards.values() if r is not None),
            "scores": {k: r["score"] for k, r in rewards.items() if r is not None},
        }
    return out


# `make test-extended` (.ci/run's second stage): builds verifiers' venv
@pytest.mark.extended
def test_vf_eval_through_the_gateway_buffers_its_groups_with_verifiers_rewards(
    vf_python, rollout, redis_url, run_id, tokenizer, tmp_path
):
    before = counts()
    summary, _ = run_vf_eval(vf_python, rollout.url, tmp_path)

    traces = verifiers_rollouts(tmp_path / "out" / RUN / "traces.jsonl")
    assert len(traces) == TASKS * ROLLOUTS
    assert sorted(t["task"] for t in traces.values()) == [0, 0, 1, 1, 2, 2]
    failed = [tid for tid, t in traces.items() if not t["ok"]]
    assert [traces[tid]["task"] for tid in failed] == [2]
    assert summary["groups"] == {"buffered": 2, "duplicate": 0, "failed": 1}
    assert summary["vf_eval_exit"] == 0 and summary["not_named"] == [] and summary["unreadable"] == []
    # The rubric scored what the gateway generated (the answers verifiers recorded).
    for t in traces.values():
        if t["ok"]:
            assert t["scores"] == {"odd_length": len(t["answer"]) % 2, "has_e": float("e" in t["answer"])}

    buf = Buffer(redis_url, run_id)
    taken = (
        Groups(buf, "test-trainer")
        .take(10, current_version=PolicyVersions(buf).version(), max_staleness=10**6, block_ms=2000)
        .groups
    )
    assert len(taken) == 2
    by_answer = {t["answer"]: (tid, t) for tid, t in traces.items() if t["ok"]}
    seen = set()
    for group in taken:
        assert len(group.samples) == ROLLOUTS
        tasks = set()
        for sample in group.samples:
            tid, t = by_answer[sample.text]
            seen.add(tid)
            tasks.add(t["task"])
            assert sample.reward == pytest.approx(t["reward"])
            assert sample.reward_status.value == "scored"
            # Token-exact: the completion decodes to the answer, the prompt is the task's rendered.
            assert tokenizer.decode(list(sample.completion_ids), skip_special_tokens=True) == sample.text
            assert len(sample.behavior_logprobs) == len(sample.completion_ids) > 0
            assert list(sample.versions) == [0] * len(sample.completion_ids)
            prompt = f"Task {t['task']}: tell me about the number {t['task']}."
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            assert list(group.prompt_tokens) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert len(tasks) == 1  # one group = the rollouts of one task
    assert seen == {tid for tid, t in traces.items() if t["ok"] and t["task"] != 2}
    assert (
        len({t["reward"] for t in traces.values() if t["ok"]}) > 1
    )  # the rewards differ, so the match means something

    # The failed rollout failed its group whole: counted, its sibling's session dropped.
    assert delta(before) == {
        "group_buffered": 2,
        "group_failed": 1,
        "rollout_verifiers_error": 1,
        "rollout_group_failed": 1,
    }
    [sibling] = [tid for tid, t in traces.items() if t["task"] == 2 and t["ok"]]
    assert not buf.redis.exists(buf.keys.prefix + f"gw:session:{RUN}.t.{sibling}")
    assert not buf.redis.exists(buf.keys.prefix + f"gw:calls:{RUN}.t.{sibling}")


def test_a_group_named_again_is_not_buffered_twice_and_one_without_calls_fails(rollout, redis_url, run_id):
    def chat(trace: str) -> httpx.Response:
        return httpx.post(
            f"{rollout.url}/v1/runs/r2/v1/chat/completions",
            headers={"X-Session-ID": trace},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )

    assert chat("a1").status_code == 200 and chat("a2").status_code == 200
    group = {
        "group_id": "k1",
        "rollouts": [{"trace_id": "a1", "reward": 1.0}, {"trace_id": "a2", "reward": 0.25}],
    }
    before = counts()
    first = httpx.post(f"{rollout.url}/v1/runs/r2/groups", json=group, timeout=30)
    again = httpx.post(f"{rollout.url}/v1/runs/r2/groups", json=group, timeout=30)
    assert (first.status_code, first.json()["group"]) == (200, "buffered")
    assert (again.status_code, again.json()["group"]) == (200, "duplicate")

    buf = Buffer(redis_url, run_id)
    [put] = Groups(buf, "t").take(5, current_version=0, max_staleness=10**6, block_ms=2000).groups
    assert sorted(s.reward for s in put.samples) == [0.25, 1.0]

    # A rollout verifiers scored but that never called this run: the group fails, with why.
    assert chat("b1").status_code == 200
    lost = {
        "group_id": "k2",
        "rollouts": [{"trace_id": "b1", "reward": 1.0}, {"trace_id": "b9", "reward": 0.0}],
    }
    answer = httpx.post(f"{rollout.url}/v1/runs/r2/groups", json=lost, timeout=30).json()
    assert answer == {
        "group_id": "k2",
        "group": "failed",
        "reason": "rollout b9 made no model call through this run (or its session expired)",
        "dropped": 1,
    }
    assert delta(before) == {"group_buffered": 1, "group_duplicate": 1, "group_failed": 1, "rollout_no_session": 1,
                             "rollout_group_failed": 1}  # fmt: skip

    # A group short of the run's rollouts per task (vf-eval exited before writing them all).
    assert chat("c1").status_code == 200
    short = {"group_id": "k3", "num_rollouts": 2, "rollouts": [{"trace_id": "c1", "reward": 1.0}]}
    answer = httpx.post(f"{rollout.url}/v1/runs/r2/groups", json=short, timeout=30).json()
    assert (answer["group"], answer["reason"], answer["dropped"]) == (
        "failed", "1 of the run's 2 rollouts per task were named", 1,
    )  # fmt: skip
    assert delta(before) == {"group_buffered": 1, "group_duplicate": 1, "group_failed": 2, "rollout_no_session": 1,
                             "rollout_group_failed": 2, "rollout_missing": 1}  # fmt: skip
    assert Groups(buf, "t").take(5, current_version=0, max_staleness=10**6, block_ms=200).groups == []
    snapshot = AdmissionControl(buf).snapshot()
    assert snapshot["running"] == 0  # the failed group's slot was given back


def test_a_run_call_without_the_trace_header_is_refused(rollout):
    resp = httpx.post(
        f"{rollout.url}/v1/runs/r3/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "no_trace_id"
