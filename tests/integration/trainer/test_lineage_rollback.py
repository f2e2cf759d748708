"""Weight-version lineage across a trainer crash (proto/lineage.py), on the real parts: Redis
(fixture), the reference engine (uvicorn thread, tiny Qwen2), the reward service (subprocess),
the rollout service (thread) and `asyncrl train` under torchrun (subprocess).

The trainer is SIGKILLed a step after its checkpoint at v=2, once the engine serves its v=3 and
the rollout has buffered groups sampled by it. The restarted trainer resumes at v=2 in epoch 1;
the engine is moved back to the checkpoint's weights, no group sampled by the lost v=3 is
trained, and the weight directories of the two histories never overwrite each other.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, serve_in_thread, start_reward_service
from test_trainer import kill_tree, process_tree, read_audit, start_trainer, wait_for

from asyncrl.buffer import Buffer, PolicyVersions, stats
from asyncrl.buffer.groups import sampled_lineage
from asyncrl.proto import Group, decode
from asyncrl.proto.lineage import Lineage
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.transport.weights import parse_weight_version

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
CONTEXT, B, FORK, STEPS = 96, 2, 2, 6


def step_logged(audit: Path, version: int) -> bool:
    return audit.exists() and f'"event": "step", "version": {version},' in audit.read_text()


def buffered_lineages(buf: Buffer) -> dict[str, dict[int, int]]:
    """group id -> lineage of every group waiting in the buffer (read without consuming)."""
    out = {}
    for _, fields in buf.redis.xrange(buf.keys.groups):
        data = buf.redis.get(buf.keys.payload_prefix + fields[b"gid"].decode())
        if data:
            g = decode(data, Group)
            out[g.group_id] = sampled_lineage(g)
    return out


def test_trainer_crash_rolls_engines_back_and_drops_the_lost_history(tmp_path, redis_url, run_id):
    model_dir = tmp_path / "tiny"
    build_tiny_model(model_dir, seed=5, max_position_embeddings=CONTEXT)
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[trainer]
redis_url = "{redis_url}"
run = "{run_id}"
model_path = "{model_dir}"
output_dir = "{out}"
batch_groups = {B}
max_staleness = 0
max_steps = {STEPS}
checkpoint_every = {FORK}
micro_batch_size = 4
minibatches = 1
heartbeat_s = 0.3
lr = 0.01
dynamic_sampling = false
publish = "disk"
publish_dtype = "float32"
# in the foreground: step 3's audit line then follows v3's announcement, so the kill after it
# cannot land between the two (a background write could lose v3 with the worker)
publish_background = false
keep_weights = 3
metrics_port = {free_port()}
block_ms = 200
device = "cpu"
""")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = serve_engine(
        str(model_dir), max_running_requests=32, max_new_tokens_cap=16, context_length=CONTEXT
    )
    reward = start_reward_service(log_path=tmp_path / "reward.log")
    buf = Buffer(redis_url, run_id)
    rollout = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, run=run_id, replica="r0", engine_urls=engine.url,
        reward_url=reward.url, tokenizer=str(model_dir), max_new_tokens_cap=16, default_max_new_tokens=6,
        heartbeat_s=0.3, recover_idle_s=1.5, recover_interval_s=0.3, claim_poll_s=0.05, admission_poll_s=0.05,
        weights_poll_s=0.3, engine_backoff_s=0.05,
    )  # fmt: skip
    log, audit = tmp_path / "trainer.log", out / "trained.jsonl"
    served = ["0"]  # every weight_version the engine took, in order (read in process, every 2 ms)
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.002):
            if engine.engine.weight_version != served[-1]:
                served.append(engine.engine.weight_version)

    def engine_version() -> str:
        return httpx.get(f"{engine.url}/get_weight_version", timeout=5).json()["weight_version"]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = None
    try:
        with httpx.Client(base_url=rollout.url, timeout=30) as client:
            prompts = [
                {"text": "".join("abcdefghij"[(i * 7 + j * 3) % 10] for j in range(4)) + ">"}
                for i in range(60)
            ]
            resp = client.post("/v1/rollouts", json={"prompts": prompts, "group_size": 2,
                                                    "reward_spec": {"verifier": "reverse"},
                                                    "sampling_params": {"max_new_tokens": 6, "temperature": 1.0}})  # fmt: skip
            assert resp.status_code == 202, resp.text

            # ---- the first trainer: steps 1-3, checkpoint at 2, SIGKILL after 3
            # η = 0: step 4 needs groups sampled wholly by v3, so it cannot follow step 3 before
            # the engine has moved and generated again (~1 s): the kill lands in between.
            proc = start_trainer(config, log, nproc=1)
            wait_for(lambda: step_logged(audit, 3), 120, "step 3", proc, poll_s=0.01)
            kill_tree(process_tree(proc.pid))
            assert not step_logged(audit, 4), "the trainer ran past step 3 before the kill"
            proc.wait(30)
            wait_for(lambda: engine_version() == "3", 30, "the engine to serve v3")
            wait_for(lambda: any(lin.get(0, -1) == 3 for lin in buffered_lineages(buf).values()), 60,
                     "a group sampled by the lost v3 in the buffer")  # fmt: skip
            doomed = {gid for gid, lin in buffered_lineages(buf).items() if lin.get(0, -1) > FORK}

            # ---- the restarted trainer: resumes at v2 in epoch 1 and trains to the end
            proc = start_trainer(config, log, nproc=1)
            assert proc.wait(180) == 0, log.read_text()[-4000:]
            wait_for(
                lambda: parse_weight_version(engine_version()) == (STEPS, 1),
                30,
                "the engine at the last version",
            )
            final = engine_version()
    finally:
        watching.set()
        if proc is not None:
            kill_tree(process_tree(proc.pid))
        rollout.stop()
        reward.stop()
        engine.stop()

    events = read_audit(audit)
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["version"], e["epoch"]) for e in resumes] == [(0, 0), (FORK, 1)]
    assert PolicyVersions(buf).lineage() == Lineage(1, {1: FORK})
    # the engine went from the lost v3 straight back to v2 of epoch 1, then only forward
    history = [parse_weight_version(v) for v in served]
    back = history.index((FORK, 1))
    assert (3, 0) in history[:back] and all(h[1] == 1 for h in history[back:]), served
    assert parse_weight_version(final) == (STEPS, 1)
    # the surviving history: epoch 0's steps up to the fork, then epoch 1's
    steps = [e for e in events if e["event"] == "step"]
    restart = resumes[1]["t"]
    survivors = [e for e in steps if e["t"] < restart and e["version"] <= FORK] + [
        e for e in steps if e["t"] > restart
    ]
    assert [e["version"] for e in survivors] == list(range(1, STEPS + 1))
    trained = [
        (gid, {int(k): v for k, v in lin.items()})
        for e in survivors
        for gid, lin in zip(e["groups"], e["sampled"])
    ]
    assert len({gid for gid, _ in trained}) == len(trained) == STEPS * B  # each group once
    for gid, lin in trained:
        # nothing sampled by the lost v3 was trained
        assert not PolicyVersions(buf).lineage().lost(lin), (gid, lin)
    lost = {gid for e in steps for gid in e["lost"]}
    assert doomed and doomed <= lost, (doomed, lost)
    assert not lost & {gid for gid, _ in trained}
    assert int(stats(buf)["counters"].get("lost", 0)) == len(lost)
    # each history's weights under its own name: the lost v3 was deleted, never overwritten
    names = sorted(p.name for p in (out / "weights").iterdir())
    assert names == [f"v{v:08d}-e1" for v in range(STEPS - 2, STEPS + 1)], names
    meta = json.loads((out / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["version"] == STEPS
