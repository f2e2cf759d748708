"""Trainer benchmarks (CPU, gloo), every figure against a baseline measured in the same run.

1. Step throughput: completion tokens/s of the trainer's FSDP2 step on 2 ranks (1 thread each)
   vs a plain single-process step (no FSDP, whole batch in one forward) of the same model and
   batch, with 1 and with 2 threads (the same two cores the 2 ranks use).
2. Weight publishing for a ~100M-parameter Qwen2: time from the end of an optimizer step to
   "version v visible", and bytes/s, for both paths, through the real trainer components
   (`trainer.parts.build`, 2 ranks):
   disk: gather → bf16 → safetensors dir (fsync + rename) → Redis `PolicyVersions.publish`; visible =
         a Redis subscriber receives the WeightsInfo of v;
   broadcast: gather → bf16 → buckets over a gloo group into a reference engine
         (`asyncrl engine` subprocess) → Redis; visible = the engine reports weight_version v.

    .venv/bin/python benchmarks/trainer_step.py            # full run (~4 min on 2 cores)
    .venv/bin/python benchmarks/trainer_step.py --quick    # smaller models, smoke test
Prints one JSON object; figures go to benchmarks/RESULTS.md (trainer section) by hand.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch


def make_groups(n_groups: int, group_size: int, prompt_len: int, completion_len: int, seed: int = 0):
    from asyncrl.proto import Group, Sample

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        samples = [Sample(prompt_id=f"p{g}", index=i, completion_ids=rng.integers(3, 40, completion_len).astype(np.int32),
                          behavior_logprobs=np.full(completion_len, -3.0, np.float32),
                          versions=np.zeros(completion_len, np.int32), finish_reason="length",
                          reward=float(rng.integers(0, 2)), reward_status="scored") for i in range(group_size)]  # fmt: skip
        groups.append(Group.build(group_id=f"g{g}", job_id="bench", prompt_tokens=rng.integers(3, 40, prompt_len).astype(np.int32),
                                  reward_spec={"verifier": "reverse"}, samples=samples, submit_version=0))  # fmt: skip
    return groups


# ----------------------------------------------------------------------------- 1. step throughput
def fsdp_step_worker(
    rank: int, world: int, port: int, model_dir: str, shape: dict, steps: int, micro: int, out: str
):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    from asyncrl.trainer.batch import build_rows, micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.model import build_model, init_distributed
    from asyncrl.trainer.step import StepConfig, policy_step, recompute_logprobs

    d = init_distributed("cpu", timeout_s=600)
    model = build_model(model_dir, d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows = build_rows(make_groups(**shape), "grpo").rows
    times = []
    for i in range(steps + 1):  # the first step warms up
        dist.barrier()
        t0 = time.perf_counter()
        mbs = micro_batches(rows, d.rank, d.world, 1, micro, 0, d.device)
        old = recompute_logprobs(model, mbs, 1.0)
        stats = policy_step(model, opt, mbs, old, [None] * len(mbs), StepConfig(loss=LossConfig()), d.device)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    if d.is_main:
        Path(out).write_text(json.dumps({"times": times, "tokens": stats["tokens"]}))
    dist.destroy_process_group()


def plain_step_throughput(model_dir: str, shape: dict, steps: int, threads: int) -> dict:
    """Plain synchronous step: one forward for π_old, one forward/backward, AdamW — no FSDP."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.batch import build_rows, collate, token_logprobs
    from asyncrl.trainer.losses import LossConfig, policy_loss

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows = build_rows(make_groups(**shape), "grpo").rows
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        batch = collate(rows, 0)
        with torch.no_grad():
            old, _ = token_logprobs(model, batch)
        lp, _ = token_logprobs(model, batch)
        loss, _ = policy_loss(lp, old, batch.behavior_logprobs, batch.advantages, batch.mask, LossConfig())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    return {"times": times, "tokens": float(batch.mask.sum())}


def spawn(world: int, target, *args) -> None:
    from asyncrl.buffer.server import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"workers failed: {[p.exitcode for p in procs]}")


def bench_step(tmp: Path, quick: bool, steps: int) -> dict:
    from asyncrl.services.ops.tinymodel import build_tiny_model

    dims = {"hidden_size": 128, "num_layers": 2, "intermediate_size": 256} if quick else \
        {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}  # fmt: skip
    model_dir = tmp / "step_model"
    model, _ = build_tiny_model(model_dir, **dims)
    params = sum(p.numel() for p in model.parameters())
    shape = {"n_groups": 4, "group_size": 8, "prompt_len": 16, "completion_len": 48}
    out = tmp / "fsdp_step.json"
    spawn(2, fsdp_step_worker, str(model_dir), shape, steps, 8, str(out))
    fsdp = json.loads(out.read_text())
    plain1 = plain_step_throughput(str(model_dir), shape, steps, 1)
    plain2 = plain_step_throughput(str(model_dir), shape, steps, 2)

    def tps(r):
        return r["tokens"] / statistics.median(r["times"])

    return {"params": params, "batch": shape, "steps": steps,
            "fsdp2_2ranks_tokens_per_s": tps(fsdp), "plain_1thread_tokens_per_s": tps(plain1),
            "plain_2threads_tokens_per_s": tps(plain2),
            "ratio_fsdp_vs_plain_1thread": tps(fsdp) / tps(plain1),
            "ratio_fsdp_vs_plain_2threads": tps(fsdp) / tps(plain2),
            "median_step_s": {"fsdp2": statistics.median(fsdp["times"]), "plain_1t": statistics.median(plain1["times"]),
                              "plain_2t": statistics.median(plain2["times"])}}  # fmt: skip


# ----------------------------------------------------------------------------- 2. weight publishing
def publish_worker(
    rank: int, world: int, port: int, settings: dict, steps: int, engine_url: str | None, out: str
):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import httpx
    import torch.distributed as dist

    from asyncrl.trainer.batch import build_rows, micro_batches
    from asyncrl.trainer.config import TrainerSettings
    from asyncrl.trainer.model import init_distributed
    from asyncrl.trainer.parts import build
    from asyncrl.trainer.step import policy_step, recompute_logprobs

    cfg = TrainerSettings(**settings)
    d = init_distributed("cpu", timeout_s=600)
    p = build(cfg, d)
    rows = build_rows(make_groups(2, 2, 8, 8), "grpo").rows
    seen: dict[int, float] = {}
    if d.is_main and cfg.publish == "disk":
        sub = p.versions.subscribe()

        def listen():
            while len(seen) < steps:
                info = sub.get(timeout=1.0)
                if info is not None:
                    seen.setdefault(info.version, time.perf_counter())

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        time.sleep(0.2)  # subscribed before the first publish
    results = []
    for v in range(1, steps + 1):
        mbs = micro_batches(rows, d.rank, d.world, 1, 4, 0, d.device)
        policy_step(p.model, p.optimizer, mbs, recompute_logprobs(p.model, mbs, 1.0), [None] * len(mbs), p.step_cfg,
                    d.device)  # fmt: skip
        dist.barrier()
        t_end_step = time.perf_counter()  # end of the optimizer step on every rank
        p.publish(v)
        if d.is_main:
            if cfg.publish == "disk":
                while v not in seen:
                    time.sleep(0.001)
                visible = seen[v]
            else:  # visible = the engine serves version v
                while httpx.get(engine_url + "/get_model_info").json().get("weight_version") != str(v):
                    time.sleep(0.001)
                visible = time.perf_counter()
            results.append(visible - t_end_step)
        dist.barrier()
    if d.is_main:
        nbytes = sum(t.numel() * 2 for t in p.model.state_dict().values())  # bf16 on the wire / disk
        Path(out).write_text(json.dumps({"latency_s": results, "bytes": nbytes}))
    dist.destroy_process_group()


def start_engine(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from asyncrl.buffer.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", str(model_dir), "--port", str(port),
                             "--device", "cpu", "--dtype", "bfloat16", "--log-level", "warning"],
                            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("engine did not start")


def bench_publish(tmp: Path, quick: bool, steps: int) -> dict:
    from asyncrl.buffer.server import RedisServer
    from asyncrl.services.ops.tinymodel import build_tiny_model

    dims = {"hidden_size": 128, "num_layers": 2, "intermediate_size": 256} if quick else \
        {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 3072}  # fmt: skip
    model_dir = tmp / "publish_model"
    model, _ = build_tiny_model(model_dir, **dims)
    params = sum(p.numel() for p in model.parameters())
    del model
    out: dict = {"params": params, "steps": steps}
    with RedisServer(tmp / "redis") as redis_server:
        base = {"redis_url": redis_server.url, "model_path": str(model_dir), "batch_groups": 2, "lr": 1e-5,
                "publish_dtype": "bfloat16", "keep_weights": 2, "device": "cpu", "audit_log": False}  # fmt: skip
        res_file = tmp / "publish_disk.json"
        spawn(2, publish_worker, {**base, "run": "disk", "output_dir": str(tmp / "out_disk"), "publish": "disk"},
              steps, None, str(res_file))  # fmt: skip
        disk = json.loads(res_file.read_text())
        engine, url = start_engine(model_dir, tmp / "engine.log")
        try:
            res_file = tmp / "publish_bcast.json"
            spawn(2, publish_worker, {**base, "run": "bcast", "output_dir": str(tmp / "out_bcast"), "publish": "distributed",
                                      "engine_urls": [url], "bucket_mb": 64}, steps, url, str(res_file))  # fmt: skip
            bcast = json.loads(res_file.read_text())
        finally:
            engine.terminate()
            engine.wait(30)
    for name, r in (("disk", disk), ("broadcast", bcast)):
        med = statistics.median(r["latency_s"])
        out[name] = {"latency_s_median": med, "latency_s_all": r["latency_s"], "bytes": r["bytes"],
                     "bytes_per_s": r["bytes"] / med}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models (smoke test)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per configuration")
    ap.add_argument("--publish-steps", type=int, default=3, help="publishes timed per path")
    ap.add_argument("--skip-publish", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        result = {"step": bench_step(tmp, args.quick, args.steps)}
        if not args.skip_publish:
            result["publish"] = bench_publish(tmp, args.quick, args.publish_steps)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
