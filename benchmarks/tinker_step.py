"""One Tinker training step (trainer/tinker: forward_backward + optim_step) on SmolLM2-135M, and
the async trainer's own step (`policy_step` + AdamW) on the same tokens in the same run, as the
baseline: the backend's overhead over the trainer it is built on.

Batch: 8 sequences of 128 tokens, every position a target (cross_entropy, weights 1; the
baseline: a 1-token prompt and a 128-token completion per row, PPO without behaviour
correction), LoRA rank 16 on every attention and MLP Linear, α 32, fp32, one torch thread,
a gloo world of one. One warm-up step each, then the median of `--steps` timed ones.

    .venv/bin/python benchmarks/tinker_step.py [--model runs/models/smollm2] [--steps 2]
Prints one JSON object; figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

ROWS, LENGTH, RANK = 8, 128, 16


def timed(fn, steps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this process) per timed step: on a shared machine the CPU
    time is the figure that does not depend on what else runs."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "runs/models/smollm2"))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from asyncrl.trainer.batch import Row, micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.step import StepConfig, policy_step
    from asyncrl.trainer.tinker import Datum, TinkerSettings, TinkerTrainer

    rng = np.random.default_rng(0)
    seqs = [rng.integers(100, 20000, LENGTH + 1) for _ in range(ROWS)]
    data = [
        Datum(
            s[:-1].tolist(), {"target_tokens": s[1:].astype(np.int64), "weights": np.ones(LENGTH, np.float32)}
        )
        for s in seqs
    ]
    root = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    settings = TinkerSettings(
        base_models={"smollm2": args.model},
        weights_root=str(root / "weights"),
        checkpoints_root=str(root / "checkpoints"),
        micro_batch_tokens=ROWS * LENGTH,
    )
    trainer = TinkerTrainer(settings)
    t0 = time.perf_counter()
    trainer.create_model("bench", "smollm2", {"rank": RANK, "seed": 0, "train_unembed": False})
    create_s = time.perf_counter() - t0

    def tinker_step():
        trainer.forward_backward("bench", data, "cross_entropy", None)
        trainer.optim_step("bench", {"learning_rate": 1e-5})

    tinker = timed(tinker_step, args.steps)

    m = trainer.model("bench")
    rows = [Row(s[:1], s[1:], np.full(LENGTH, -3.0, np.float32), 1.0, True) for s in seqs]
    micro = micro_batches(rows, 0, 1, 1, ROWS, 0, torch.device("cpu"))
    cfg = StepConfig(loss=LossConfig(is_correction="none"), chunk_tokens=settings.chunk_tokens)

    def trainer_step():
        policy_step(m.module, m.optimizer, micro, [None], [None], cfg, torch.device("cpu"))

    baseline = timed(trainer_step, args.steps)
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": f"{ROWS}x{LENGTH}",
                "lora_rank": RANK,
                "threads": 1,
                "create_model_s": round(create_s, 2),
                "tinker_step_wall_s": round(statistics.median(tinker[0]), 2),
                "tinker_step_cpu_s": round(statistics.median(tinker[1]), 2),
                "trainer_policy_step_wall_s": round(statistics.median(baseline[0]), 2),
                "trainer_policy_step_cpu_s": round(statistics.median(baseline[1]), 2),
                "adapter_parameters": int(sum(p.numel() for p in m.trainable())),
            }
        )
    )


if __name__ == "__main__":
    main()
