"""Async vs sync on the demo workload, one machine, one invocation.

Runs `asyncrl demo` with `max_staleness = 0` (synchronous on-policy) and with
`max_staleness = η` (async; default: configs/demo.toml's), same seed and time limit, and reports trainer samples/s, engine
busy ratio, trainer idle ratio, wall time to reward 0.9, the measured async/sync throughput
ratio, and the ideal overlap bound computed from the sync run's measured generation time G
(the trainer's wait per step) and training time T per step: sync needs G + T per step, perfect
overlap max(G, T), so the bound on the ratio is (G + T) / max(G, T).

    .venv/bin/python benchmarks/async_vs_sync.py [--seed 0] [--time-limit 300] [--eta 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_demo(eta: int, seed: int, time_limit: float, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "demo", "--max-staleness", str(eta), "--seed", str(seed),
           "--time-limit", str(time_limit), "--run-dir", str(run_dir)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=False, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    # throughput over the steady window: from the first trained version to the last
    first, last = rows[0], rows[-1]
    steps = last["version"] - first["version"]
    summary["samples_per_s"] = (
        steps * summary["samples_per_step"] / (last["t"] - first["t"]) if steps else 0.0
    )
    summary["step_s"] = (last["t"] - first["t"]) / steps if steps else float("nan")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument(
        "--eta",
        type=int,
        default=tomllib.loads((REPO / "configs" / "demo.toml").read_text())["trainer"]["max_staleness"],
    )
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench-async-vs-sync")
    args = ap.parse_args()

    sync = run_demo(0, args.seed, args.time_limit, args.out / "sync")
    asyn = run_demo(args.eta, args.seed, args.time_limit, args.out / f"async-eta{args.eta}")
    steps = max(sync["steps"], 1)
    g = (sync["trainer_idle_s"] or 0.0) / steps  # generation + scoring latency the sync trainer waits for
    t = (sync["trainer_busy_s"] or 0.0) / steps  # training per step
    bound = (g + t) / max(g, t) if max(g, t) > 0 else float("nan")
    ratio = asyn["samples_per_s"] / sync["samples_per_s"] if sync["samples_per_s"] else float("nan")

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    print(
        f"demo workload, seed {args.seed}, time limit {args.time_limit:.0f} s; sync G = {g:.3f} s, T = {t:.3f} s per step"
    )
    print("| run | steps | samples/s | engine busy | trainer idle | time to 0.9 | final reward |")
    print("|---|---|---|---|---|---|---|")
    for name, s in (("sync (η=0)", sync), (f"async (η={args.eta})", asyn)):
        ttt = f"{s['time_to_target_s']:.0f} s" if s["time_to_target_s"] else "not reached"
        print(f"| {name} | {s['steps']} | {s['samples_per_s']:.0f} | {fmt(s['engine_busy_ratio'])} | "
              f"{fmt(s['trainer_idle_ratio'])} | {ttt} | {s['final_reward']:.3f} |")  # fmt: skip
    print(
        f"\nasync/sync throughput ratio {ratio:.2f}; ideal overlap bound (G+T)/max(G,T) = {bound:.2f}; "
        f"async reaches {ratio / bound:.0%} of the bound (target >= 90%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
