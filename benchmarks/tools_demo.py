"""The tool-use demo (issue 18) over seeds, with the tool and without it.

    .venv/bin/python benchmarks/tools_demo.py                       # seeds 0-4 with the tool, seed 0 without
    .venv/bin/python benchmarks/tools_demo.py --seeds 0 1 --baseline-seeds 0 1 --time-limit 300

Each run is `asyncrl demo --config configs/demo-tools.toml --seed S` (the full stack: embedded
Redis, engine, reward service serving the `secret` environment, rollout service driving the
episodes, trainer), in its own run directory; the no-tool runs set `[demo] tools = false` (the
same episodes, no tool call parsed). Reported per run: time and steps to reward 0.9 (the mean
of the last 5 trainer steps) and the final reward.
Prints one JSON object and a table; figures go to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo-tools.toml"


def run(seed: int, tools: bool, time_limit: float, tmp: Path, figures: Path | None = None) -> dict:
    raw = tomllib.loads(CONFIG.read_text())
    raw["demo"]["tools"] = tools
    sys.path.insert(0, str(ROOT))
    import tomli_w  # the demo's own writer of the run config

    config = tmp / f"config-{seed}-{int(tools)}.toml"
    config.write_text(tomli_w.dumps(raw))
    run_dir = tmp / f"run-{seed}-{'tools' if tools else 'none'}"
    cmd = [str(ROOT / ".venv" / "bin" / "asyncrl"), "demo", "--config", str(config), "--seed", str(seed),
           "--time-limit", str(time_limit), "--run-dir", str(run_dir)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    if figures is not None and (run_dir / "demo.png").exists():
        figures.mkdir(parents=True, exist_ok=True)
        shutil.copy(
            run_dir / "demo.png", figures / f"tools-demo-seed{seed}-{'tool' if tools else 'no-tool'}.png"
        )
    return {"seed": seed, "tools": tools, "time_to_0.9_s": summary.get("time_to_target_s"), "steps": summary["steps"],
            "wall_s": summary["wall_s"], "final_reward": summary["final_reward"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--baseline-seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--figures", type=Path, help="copy each run's curves (demo.png) here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tools-demo-") as tmp:
        for seed in args.seeds:
            rows.append(run(seed, True, args.time_limit, Path(tmp), args.figures))
            print(json.dumps(rows[-1]), flush=True)
        for seed in args.baseline_seeds:
            rows.append(run(seed, False, args.time_limit, Path(tmp), args.figures))
            print(json.dumps(rows[-1]), flush=True)
    reached = [
        r
        for r in rows
        if r["tools"] and r["time_to_0.9_s"] is not None and r["time_to_0.9_s"] <= args.time_limit
    ]
    out = {"machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end", "runs": rows,
           "with_tool_reached_0.9": f"{len(reached)} of {sum(r['tools'] for r in rows)}"}  # fmt: skip
    print(json.dumps(out, indent=2))
    print("\n| seed | tool | time to 0.9 | steps | final reward | wall |\n|---|---|---|---|---|---|")
    for r in rows:
        t = f"{r['time_to_0.9_s']:.0f} s" if r["time_to_0.9_s"] is not None else "not reached"
        print(
            f"| {r['seed']} | {'yes' if r['tools'] else 'no'} | {t} | {r['steps']} | {r['final_reward']:.3f} | {r['wall_s']:.0f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
