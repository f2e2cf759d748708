"""Core sharing on and off, paired: `asyncrl demo` (or any run config) seed by seed.

For each seed the demo runs twice, once with `--core-share on` and once with `off`, the order
alternating from seed to seed, one run at a time on the same machine. Per run: time to the
reward target, steps, trainer tokens/s, engine busy ratio, trainer idle ratio, and with
sharing on the seconds each process had work on 1 and on 2 threads and waited for a core.

    .venv/bin/python benchmarks/core_share_demo.py --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/core_share_demo.py --config configs/smollm2-math.toml --seeds 0 --time-limit 600

Prints a markdown table and one JSON line; the figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str | None, seed: int, mode: str, run_dir: Path, time_limit: float | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "demo",
        "--seed",
        str(seed),
        "--core-share",
        mode,
    ]
    cmd += ["--run-dir", str(run_dir)]
    if config:
        cmd += ["--config", config]
    if time_limit:
        cmd += ["--time-limit", str(time_limit)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    summary = run_dir / "summary.json"
    if not summary.exists():
        raise RuntimeError(
            f"demo seed {seed} core_share={mode} failed ({out.returncode}): {out.stderr[-2000:]}"
        )
    s = json.loads(summary.read_text())
    return {**s, "seed": seed, "mode": mode, "code": out.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="run config (default: the demo's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--time-limit", type=float)
    ap.add_argument("--out", type=Path, help="keep the run directories here (default: a temp dir)")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="core-share-"))
    rows = []
    for i, seed in enumerate(args.seeds):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            r = run(args.config, seed, mode, base / f"s{seed}-{mode}", args.time_limit)
            rows.append(r)
            print(
                f"seed {seed} {mode}: time to target {r.get('time_to_target_s')} s, {r['steps']} steps",
                flush=True,
            )
    print()
    print("| seed | core share | time to target s | steps | steps/min | trainer tokens/s | engine busy | "
          "trainer idle | trainer busy s on 1 / 2 threads | engine busy s on 1 / 2 threads | waits s (trainer / engine) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for r in rows:
        cs = r.get("core_share") or {}
        t, e = cs.get("trainer", {}), cs.get("engine", {})

        def pair(d):
            return f"{d.get('busy_s_1_threads', 0):.0f} / {d.get('busy_s_2_threads', 0):.0f}" if d else "—"

        waits = f"{t.get('wait_s', 0):.1f} / {e.get('wait_s', 0):.1f}" if cs else "—"
        ttt = r.get("time_to_target_s")
        print(f"| {r['seed']} | {r['mode']} | {ttt:.1f} | {r['steps']} | {60 * r['steps'] / r['wall_s']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['engine_busy_ratio']:.2f} | {r['trainer_idle_ratio']:.2f} | "
              f"{pair(t)} | {pair(e)} | {waits} |" if ttt is not None else
              f"| {r['seed']} | {r['mode']} | not reached | {r['steps']} | | | | | | | |")  # fmt: skip
    by = {m: [r.get("time_to_target_s") for r in rows if r["mode"] == m] for m in ("on", "off")}
    reached = {m: [x for x in v if x is not None] for m, v in by.items()}
    pairs = [
        (a["time_to_target_s"], b["time_to_target_s"])
        for a in rows
        if a["mode"] == "on"
        for b in rows
        if b["mode"] == "off" and b["seed"] == a["seed"]
        if a.get("time_to_target_s") and b.get("time_to_target_s")
    ]
    summary = {
        "median_time_to_target_s": {m: statistics.median(v) if v else None for m, v in reached.items()},
        "reached": {m: f"{len(reached[m])}/{len(by[m])}" for m in by},
        "on_over_off_per_seed": [round(a / b, 3) for a, b in pairs],
        "runs": [
            {
                k: r.get(k)
                for k in (
                    "seed",
                    "mode",
                    "time_to_target_s",
                    "steps",
                    "wall_s",
                    "tokens_per_s",
                    "engine_busy_ratio",
                    "trainer_idle_ratio",
                    "core_share",
                )
            }
            for r in rows
        ],  # fmt: skip
    }
    print()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
