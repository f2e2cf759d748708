"""`asyncrl buffer stats`: depths, version, pending entries, counters and staleness of a run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from asyncrl.buffer import metrics as m
from asyncrl.buffer.admission import AdmissionControl
from asyncrl.buffer.connection import ROLLOUT_GROUP, TRAINER_GROUP, Buffer


def stats(buf: Buffer) -> dict:
    """The run-wide numbers the scripts keep in Redis."""
    k = buf.keys
    pipe = buf.redis.pipeline(transaction=False)
    for stream in (k.jobs, k.groups, k.deadletter, k.stale):
        pipe.xlen(stream)
    pipe.hgetall(k.stats).hgetall(k.staleness).xpending(k.groups, TRAINER_GROUP).xpending(
        k.jobs, ROLLOUT_GROUP
    )
    jobs, groups, dead, stale, counters, hist, pending_groups, pending_jobs = pipe.execute()
    for name, depth in (("jobs", jobs), ("groups", groups), ("deadletter", dead), ("stale", stale)):
        m.DEPTH.labels(name).set(depth)
    histogram = {int(s): int(c) for s, c in hist.items()}
    total = sum(histogram.values())
    return {
        "run": buf.run,
        "depth": {"jobs": jobs, "groups": groups, "deadletter": dead, "stale": stale},
        "pending": {"groups": pending_groups["pending"], "jobs": pending_jobs["pending"]},
        "counters": {key.decode(): int(v) for key, v in counters.items()},
        "admission": AdmissionControl(buf).snapshot(),
        "staleness": {
            "histogram": dict(sorted(histogram.items())),
            "count": total,
            "mean": sum(s * c for s, c in histogram.items()) / total if total else 0.0,
            "max": max(histogram) if histogram else None,
        },
    }


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
    cmd = sub.add_parser("stats", help="print depths, version, pending, counters and staleness")
    cmd.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="default: $REDIS_URL or the run dir's embedded Redis",
    )
    cmd.add_argument("--run", default=os.environ.get("ASYNCRL_RUN", "default"))
    cmd.add_argument("--run-dir", type=Path, default=Path(os.environ.get("ASYNCRL_RUN_DIR", "runs/default")))
    cmd.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    from asyncrl.buffer.server import ensure_redis

    owned = None
    url = args.redis_url
    if not url:
        url, owned = ensure_redis(args.run_dir)
    try:
        numbers = stats(Buffer(url, run=args.run))
        print(json.dumps(numbers, indent=2) if args.json else _format(numbers))
    finally:
        if owned is not None:
            owned.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
