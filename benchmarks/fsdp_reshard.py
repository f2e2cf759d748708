"""Which FSDP2 units to reshard after forward (trainer/model.py build_model), measured on 2 gloo
ranks: the trainer's step (`trainer.step.policy_step`: forward, loss, backward, clipping, AdamW)
with every unit resharded after forward (the policy before #17's session 15) against the root
(embeddings, final norm, LM head) and the last decoder layer kept gathered for the backward that
starts with them. Same processes, same model, same micro-batches; the two policies alternate step
by step (FSDP2's `set_reshard_after_forward` on those two units), so both see the same load.

Model: benchmarks/trainer_memory.py's Qwen3 shape (vocabulary 151,936, hidden 256, 28 layers,
tied embeddings); batch: 8 samples of 32–160 tokens, 2 micro-batches per rank. Short samples keep
the step's compute small, as a GPU's is against its all-gathers. Reported per step: time, and the
bytes each rank all-gathers (`dist.all_gather_single`, FSDP2's all-gather).

    .venv/bin/python benchmarks/fsdp_reshard.py              # ~2 min on 2 cores
    .venv/bin/python benchmarks/fsdp_reshard.py --steps 3 --vocab 32000   # smoke test
Prints one JSON object; figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

POLICIES = ("reshard_all", "keep_backward_start")


def worker(rank: int, port: int, model_dir: str, vocab: int, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    from asyncrl.trainer.batch import build_rows, micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.model import _decoder_layers, build_model, init_distributed
    from asyncrl.trainer.step import StepConfig, policy_step
    from benchmarks.trainer_memory import make_groups

    gathered = [0]
    all_gather = dist.all_gather_single

    def counting(output, *args, **kwargs):
        gathered[0] += output.numel() * output.element_size()
        return all_gather(output, *args, **kwargs)

    dist.all_gather_single = counting
    d = init_distributed("cpu", timeout_s=600)
    model = build_model(model_dir, d)
    kept = [model, _decoder_layers(model)[-1]]  # what build_model keeps gathered for backward
    rows = build_rows(make_groups(vocab, seed=1, samples=8, max_len=160), "grpo").rows
    micro = micro_batches(rows, d.rank, d.world, 1, 2, 0, d.device)
    cfg = StepConfig(loss=LossConfig(), grad_clip=1.0, entropy_coef=0.0, chunk_tokens=1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    figures: dict[str, dict[str, list[float]]] = {p: {"step_s": [], "gathered_bytes": []} for p in POLICIES}
    for i in range(2 * (steps + 1)):
        policy = POLICIES[i % 2]
        for unit in kept:
            unit.set_reshard_after_forward(policy == "reshard_all", recurse=False)
        dist.barrier()
        gathered[0] = 0
        t0 = time.perf_counter()
        policy_step(model, opt, micro, [None] * len(micro), [None] * len(micro), cfg, d.device)
        seconds = time.perf_counter() - t0
        if i >= 2:  # one warm-up step each
            figures[policy]["step_s"].append(seconds)
            figures[policy]["gathered_bytes"].append(gathered[0])
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def main() -> int:
    from asyncrl.buffer.server import free_port
    from benchmarks.trainer_memory import SHAPE, VOCAB, build_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="timed steps per policy")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model_dir(model_dir, args.vocab)
        out = Path(tmp) / "figures.json"
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, str(model_dir), args.vocab, args.steps, str(out)))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        figures = json.loads(out.read_text())
    result: dict = {"model": {"architecture": "Qwen3", "vocab_size": args.vocab, **SHAPE, "tie_word_embeddings": True},
                    "ranks": 2, "backend": "gloo", "steps_per_policy": args.steps}  # fmt: skip
    for policy in POLICIES:
        f = figures[policy]
        result[policy] = {"step_ms": round(statistics.median(f["step_s"]) * 1000, 1),
                          "all_gathered_MiB_per_step": round(statistics.median(f["gathered_bytes"]) / 2**20, 1)}  # fmt: skip
    base, new = result["reshard_all"], result["keep_backward_start"]
    result["step_time_ratio"] = round(new["step_ms"] / base["step_ms"], 3)
    result["all_gathered_ratio"] = round(
        new["all_gathered_MiB_per_step"] / max(base["all_gathered_MiB_per_step"], 1e-9), 3
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
