"""`asyncrl buffer stats`: depths, version, pending entries, counters and staleness of a run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _format(stats: dict) -> str:
    a, s = stats["admission"], stats["staleness"]
    lines = [
        f"run {stats['run']}  version {a['version']}  B={a['batch_groups']}  eta={a['max_staleness']}",
        "depth    " + "  ".join(f"{k}={v}" for k, v in stats["depth"].items()),
        "pending  " + "  ".join(f"{k}={v}" for k, v in stats["pending"].items()),
        f"admission accepted={a['accepted']}  running={a['running']}  capacity={a['capacity']}",
        "counters " + ("  ".join(f"{k}={v}" for k, v in sorted(stats["counters"].items())) or "(none)"),
        f"staleness count={s['count']}  mean={s['mean']:.2f}  max={s['max']}  "
        + " ".join(f"{k}:{v}" for k, v in s["histogram"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl buffer", description="Inspect the replay buffer.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    stats = sub.add_parser("stats", help="print depths, version, pending, counters and staleness")
    stats.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL or the run dir's embedded Redis")
    stats.add_argument("--run", default=os.environ.get("ASYNCRL_RUN", "default"))
    stats.add_argument("--run-dir", type=Path, default=Path(os.environ.get("ASYNCRL_RUN_DIR", "runs/default")))
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    from buffer.replay import ReplayBuffer
    from buffer.server import ensure_redis

    owned = None
    url = args.redis_url
    if not url:
        url, owned = ensure_redis(args.run_dir)
    try:
        buf = ReplayBuffer(url, run=args.run, consumer="stats")
        stats_ = buf.stats()
        print(json.dumps(stats_, indent=2) if args.json else _format(stats_))
    finally:
        if owned is not None:
            owned.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
