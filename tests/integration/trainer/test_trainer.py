"""`asyncrl train` end to end: 2-process torchrun (gloo), the tiny Qwen2 model, the real Redis
buffer. The trainer is SIGKILLed mid-run with consumed-but-unacked groups, restarted with the
same config, and must finish with every group either trained exactly once in the surviving
lineage, dropped for staleness, or discarded for zero reward spread; its published weights
reload bit-identically in a fresh process.

Plan (B = 2 groups/step, η = 3, checkpoint every 2 steps, max_steps 10):
  phase 1 puts g00, Z (zero spread), g01..g06 → steps 1-3 run, checkpoint at v=2, g04-g06
           consumed after it; the test SIGKILLs torchrun and both workers at once while the
           trainer waits for g07.
  phase 2 puts g07..g19 with S10, S15 (min_version 0: stale once v ≥ 4) among them, and L3,
           sampled by the killed run's v=3 (a history the resumed run abandons), and restarts.
Trainable group k carries min_version k // 2, the version it is trained at (staleness 0), except
g06 (v=2: phase 1 is the killed run, which published up to v=3, and what its v=3 sampled is a lost
history); phase 2's groups above v=2 were sampled by the resumed run, epoch 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from msgspec.structs import replace
from waiting import wait_until

from asyncrl.buffer import Buffer, Groups, PolicyVersions, stats
from asyncrl.buffer.server import free_port
from asyncrl.proto import Group, Sample

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
B, STEPS = 2, 10


def make_group(
    gid: str, min_version: int, rng: np.random.Generator, rewards=None, timeout_sample: bool = False
):
    rewards = rewards if rewards is not None else [1.0, 0.0, float(rng.integers(0, 2)), 0.5]
    samples = []
    for i, r in enumerate(rewards):
        n = int(rng.integers(3, 7))
        failed = timeout_sample and i == 1
        samples.append(Sample(
            prompt_id=f"p-{gid}", index=i, completion_ids=rng.integers(3, 40, n).astype(np.int32),
            behavior_logprobs=np.full(n, -3.5, np.float32), versions=np.full(n, min_version, np.int32),
            finish_reason="length", reward=None if failed else r, reward_status="timeout" if failed else "scored",
        ))  # fmt: skip
    return Group.build(group_id=gid, job_id="job-1", prompt_tokens=np.array([1, 5, 6, 7, 8, 40], np.int32),
                       reward_spec={"verifier": "reverse"}, samples=samples, submit_version=min_version)  # fmt: skip


def read_audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout: float, what: str, proc=None, poll_s: float = 0.1):
    """`wait_until`, failing at once if the trainer `proc` exits first."""

    def done() -> bool:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) while waiting for {what}")
        return False

    wait_until(done, timeout=timeout, interval=poll_s, message=what)


def waiting_heartbeats(port: int) -> float:
    """asyncrl_trainer_wait_heartbeats_total on the trainer's /metrics (0 before the first)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    beats = [ln for ln in text.splitlines() if ln.startswith("asyncrl_trainer_wait_heartbeats_total ")]
    return float(beats[0].split()[1]) if beats else 0.0


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun starts its workers in sessions of their own)."""
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], check=False, capture_output=True, text=True
    ).stdout
    return [pid] + [p for c in children.split() for p in process_tree(int(c))]


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_trainer(config: Path, log: Path, nproc: int = 2) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.services.ops.cli",
            "train",
            "--config",
            str(config),
            "--nproc-per-node",
            str(nproc),
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_train_kill_resume_exactly_once(tmp_path, redis_url, run_id):
    from asyncrl.services.ops.tinymodel import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(model_dir, seed=3)
    out = tmp_path / "out"
    port = free_port()
    config = tmp_path / "run.toml"
    config.write_text(f"""
[trainer]
redis_url = "{redis_url}"
run = "{run_id}"
model_path = "{model_dir}"
output_dir = "{out}"
batch_groups = {B}
max_staleness = 3
max_steps = {STEPS}
checkpoint_every = 2
micro_batch_size = 2
minibatches = 2
heartbeat_s = 0.3
lr = 0.001
dynamic_sampling = true
publish = "disk"
publish_dtype = "float32"
keep_weights = 2
metrics_port = {port}
block_ms = 200
device = "cpu"

[trainer.loss]
kind = "ppo"
is_correction = "tis"
""")
    rng = np.random.default_rng(0)
    buf = Buffer(redis_url, run_id)
    trainable = [f"g{k:02d}" for k in range(20)]
    phase1 = [make_group("g00", 0, rng), make_group("Z", 0, rng, rewards=[1.0, 1.0, 1.0, 1.0])]
    phase1 += [make_group(f"g{k:02d}", min(k // B, 2), rng, timeout_sample=(k == 3)) for k in range(1, 7)]
    phase2 = []
    for k in range(7, 20):
        phase2.append(replace(make_group(f"g{k:02d}", k // B, rng), lineage={1: k // B}))
        if k in (10, 15):
            phase2.append(make_group(f"S{k}", 0, rng))
        if k == 8:  # tokens of epoch 0's v=3: the resumed trainer (epoch 1) forks at v=2
            phase2.append(replace(make_group("L3", 3, rng), lineage={0: 3}))
    for g in phase1:
        assert Groups(buf).put([g]) == [True]
    audit = out / "trained.jsonl"
    log = tmp_path / "trainer.log"

    # ---- phase 1: train until v=3 is published (checkpoint at v=2), then SIGKILL everything
    proc = start_trainer(config, log)
    try:
        wait_for(lambda: audit.exists() and any(e["event"] == "step" and e["version"] == 3 for e in read_audit(audit)),
                 90, "step 3", proc)  # fmt: skip
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        health = httpx.get(f"http://127.0.0.1:{port}/healthz").json()
        wait_for(lambda: stats(buf)["pending"]["groups"] == 3 and waiting_heartbeats(port) >= 2, 30,
                 "the trainer waits for data (ranks exchanging heartbeats) holding g06 unacked", proc)  # fmt: skip
        heartbeats = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        tree = process_tree(proc.pid)
        assert len(tree) >= 3  # torchrun + 2 workers
    finally:
        kill_tree(process_tree(proc.pid))  # a crash: every process at once, no cleanup
        proc.wait(30)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in tree[1:]), 30, "workers to die")
    assert health["version"] == 3 and health["state"] == "training"
    assert "asyncrl_trainer_version 3.0" in metrics
    assert 'asyncrl_trainer_groups_total{outcome="zero_spread"} 1.0' in metrics
    assert 'asyncrl_trainer_samples_masked_total{reason="timeout"} 1.0' in metrics
    assert 'asyncrl_trainer_phase_seconds_count{phase="forward_backward"} 3.0' in metrics
    beats = [ln for ln in heartbeats.splitlines() if ln.startswith("asyncrl_trainer_wait_heartbeats_total ")]
    assert beats and float(beats[0].split()[1]) >= 2  # waiting ranks kept exchanging heartbeats
    pending_at_kill = stats(buf)["pending"]["groups"]
    assert pending_at_kill == 3  # g04, g05 (trained in v=3, not checkpointed) and g06 (taken)

    # ---- phase 2: the rest of the data, same config, resume
    for g in phase2:
        assert Groups(buf).put([g]) == [True]
    proc = start_trainer(config, log)
    try:
        assert proc.wait(120) == 0, log.read_text()[-4000:]
    finally:
        kill_tree(process_tree(proc.pid))

    events = read_audit(audit)
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["version"], e["epoch"], e["reclaimed"]) for e in resumes] == [(0, 0, 0), (2, 1, 3)]
    # the surviving lineage: a version's last entry wins (the resumed run redoes v=3)
    lineage: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            lineage[e["version"]] = e
    assert sorted(lineage) == list(range(1, STEPS + 1))
    trained = [gid for v in sorted(lineage) for gid in lineage[v]["groups"]]
    assert len(trained) == len(set(trained)) == 20, trained
    assert set(trained) == set(trainable)
    dropped = {gid for e in events if e["event"] == "step" for gid in e["dropped"]}
    lost = {gid for e in events if e["event"] == "step" for gid in e["lost"]}
    discarded = {gid for e in events if e["event"] == "step" for gid in e["discarded"]}
    assert dropped == {"S10", "S15"} and discarded == {"Z"} and lost == {"L3"}
    all_put = {g.group_id for g in phase1 + phase2}
    exits = set(trained) | dropped | discarded | lost
    assert exits == all_put and len(trained) + len(dropped) + len(discarded) + len(lost) == len(all_put)
    stale_ids = {f[b"gid"].decode() for _, f in buf.redis.xrange(buf.keys.stale)}
    assert stale_ids == dropped | lost
    numbers = stats(buf)
    assert numbers["pending"]["groups"] == 0 and numbers["depth"]["groups"] == 0
    assert numbers["counters"].get("zero_spread") == 1 and numbers["counters"].get("lost") == 1
    assert PolicyVersions(buf).version() == STEPS
    # the resumed run's weights live beside, never over, the killed run's
    assert PolicyVersions(buf).lineage().forks == {1: 2}
    assert sorted(p.name for p in (out / "weights").iterdir()) == [f"v{STEPS - 1:08d}-e1", f"v{STEPS:08d}-e1"]

    # ---- published weights reload bit-identically in a fresh process
    info = PolicyVersions(buf).latest()
    assert (info.version, info.epoch, info.method) == (STEPS, 1, "disk")
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # the sharded checkpoint: each rank wrote its own file; gathered offline into one state dict
    final_ckpt = out / "checkpoints" / f"step_{STEPS:08d}"
    assert {p.name for p in final_ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    dcp_to_torch_save(final_ckpt, tmp_path / "final.pt")
    trained_state = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    script = (
        "import hashlib, json, sys, torch; torch.set_num_threads(1);"
        "from transformers import AutoModelForCausalLM;"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32);"
        "sd = m.state_dict();"
        "print(json.dumps({k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in sd.items()}))"
    )
    res = subprocess.run([sys.executable, "-c", script, info.path], check=False, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    expected = {
        k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in trained_state.items()
    }
    assert loaded == expected  # includes lm_head.weight == the trained (tied) embedding
    from safetensors.torch import load_file  # training moved the weights away from the initial model

    init_sd = load_file(model_dir / "model.safetensors")
    assert not torch.equal(init_sd["model.embed_tokens.weight"], trained_state["model.embed_tokens.weight"])


def test_sigterm_checkpoints_and_acks_before_exit(tmp_path, redis_url, run_id):
    """SIGTERM (what docker/k8s send) stops after the current step: the steps since the last
    checkpoint become durable and acked, nothing stays pending, no group is lost."""
    from asyncrl.services.ops.tinymodel import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(model_dir, seed=4)
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[trainer]
redis_url = "{redis_url}"
run = "{run_id}"
model_path = "{model_dir}"
output_dir = "{out}"
batch_groups = 2
max_staleness = 8
checkpoint_every = 100
micro_batch_size = 4
publish = "none"
block_ms = 200
heartbeat_s = 0.5
device = "cpu"
""")
    rng = np.random.default_rng(1)
    buf = Buffer(redis_url, run_id)
    for k in range(5):  # 2 full steps, then one group that never completes a batch
        assert Groups(buf).put([make_group(f"g{k}", 0, rng)]) == [True]
    audit = out / "trained.jsonl"
    proc = start_trainer(config, tmp_path / "trainer.log")
    try:
        wait_for(lambda: audit.exists() and any(e["event"] == "step" and e["version"] == 2 for e in read_audit(audit)),
                 90, "step 2", proc)  # fmt: skip
        # g0-g3 are acked only at the checkpoint SIGTERM writes: all five are pending once g4 is taken
        wait_for(lambda: stats(buf)["pending"]["groups"] == 5, 30, "the trainer waits, holding g4", proc)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        kill_tree(process_tree(proc.pid))
    events = read_audit(audit)
    assert [e["version"] for e in events if e["event"] == "checkpoint"] == [2]
    assert (out / "checkpoints" / "step_00000002" / "meta.json").exists()
    numbers = stats(buf)
    # g0-g3 trained and acked; g4 (taken, not trained) was handed back to the stream's pending
    # list and is reclaimed by the next start
    assert numbers["counters"].get("trained") == 4
    assert numbers["pending"]["groups"] == 1 and numbers["depth"]["groups"] == 1
