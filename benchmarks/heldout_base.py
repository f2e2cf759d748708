"""The base model's figures on a demo config's held-out sets, through the stack a run evaluates
with: the reference engine (the config's dtype, 1 thread), the reward service (the config's
`[reward]`: strict math for SmolLM2) and the rollout service's `/v1/evaluations`, greedy, at most
`[demo] max_new_tokens` new tokens. No training: version 0 only, what a run's first automatic
evaluation reports, in minutes rather than a run's hour.

    .venv/bin/python benchmarks/heldout_base.py [--config configs/smollm2-math.toml] [--size N]

Prints one row per held-out set: strict accuracy, format rate, accuracy among formatted answers,
mean length and seconds; `--size` evaluates each set's first N problems only. Nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test tiers' loopback servers (engine, rollout, reward)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-math.toml")
    parser.add_argument("--size", type=int, help="the first N problems of each set (default: all)")
    args = parser.parse_args(argv)

    import torch
    from engine_server import serve_in_thread as serve_engine
    from rollout_server import serve_in_thread, start_reward_service
    from transformers import AutoTokenizer

    from asyncrl.buffer import AdmissionControl, Buffer
    from asyncrl.buffer.server import RedisServer
    from asyncrl.services.ops.demo_jobs import heldout_sets
    from asyncrl.services.ops.run_config import load_run_config

    torch.set_num_threads(1)
    cfg = load_run_config(args.config, require=("model",))
    raw = tomllib.loads(args.config.read_text())
    model = str(Path(cfg.model.path).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="heldout-base-"))
    sets = heldout_sets(cfg.demo, tmp, raw)
    redis = RedisServer(tmp / "redis").start()
    reward = start_reward_service(log_path=tmp / "reward.log", args=("--config", str(args.config)))
    engine = serve_engine(model, dtype=cfg.engine.dtype, max_new_tokens_cap=cfg.engine.max_new_tokens_cap,
                          max_running_requests=cfg.engine.max_running_requests, num_threads=1)  # fmt: skip
    run = f"base{uuid.uuid4().hex[:8]}"
    AdmissionControl(Buffer(redis.url, run)).configure(batch_groups=1, max_staleness=0)
    rollout = serve_in_thread(redis.url, loaded_tokenizer=AutoTokenizer.from_pretrained(model), run=run,
                              engine_urls=engine.url, reward_url=reward.url, tokenizer=model,
                              max_new_tokens_cap=cfg.rollout.max_new_tokens_cap)  # fmt: skip
    print(f"{args.config.name}: {model}, engine {cfg.engine.dtype}, math strict {cfg.reward.math_strict}")
    print("| set | problems | accuracy | format rate | accuracy among formatted | mean length | s |")
    print("|---|---|---|---|---|---|---|")
    try:
        with httpx.Client(base_url=rollout.url, timeout=60) as client:
            for name, prompts in sets.items():
                t0 = time.monotonic()
                body = {"name": name, "prompts": prompts[: args.size],
                        "sampling_params": {"temperature": 0.0, "max_new_tokens": cfg.demo.max_new_tokens}}  # fmt: skip
                resp = client.post("/v1/evaluations", json=body)
                resp.raise_for_status()
                while (r := client.get(f"/v1/evaluations/{resp.json()['eval_id']}").json())["state"] not in (
                    "done",
                    "failed",
                ):
                    time.sleep(2.0)
                if r["state"] == "failed":
                    print(f"| {name} | failed: {r['error']} |")
                    continue
                among = "-" if r["formatted_accuracy"] is None else f"{r['formatted_accuracy']:.3f}"
                fmt = "-" if r["format_rate"] is None else f"{r['format_rate']:.3f} ({r['formatted']})"
                print(f"| {name} | {r['prompts']} | {r['accuracy']:.3f} ({r['correct']}) | {fmt} | {among} | "
                      f"{r['mean_length']:.0f} | {time.monotonic() - t0:.0f} |", flush=True)  # fmt: skip
    finally:
        rollout.stop()
        engine.stop()
        reward.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
