"""Load on the rollout service's front door: open-loop `POST /v1/rollouts` at fixed offered
rates, then the accounting.

Topology (all real, loopback): a redis-server, the reward service (`asyncrl reward`), the
rollout service (`asyncrl rollout`, its own process and core) with no engine reachable, so what
is measured is admission (validation, tokenization, the verifier check, the enqueue) and not
generation. Each rate runs for `--seconds`: requests are started on schedule whether or not the
earlier ones have answered (open loop: a slow server sees the queue grow, as it would in
production), each carrying `--prompts` prompts.

Reported per rate: offered jobs/s, answers and the rate achieved (answers over the time from
the first scheduled send to the last answer), latency p50/p99 (from the scheduled send time,
so queueing in the client counts: one client process on these 2 cores falls behind its
schedule first), the status codes, and whether `/health` stayed fast
(its worst latency, probed every 100 ms from a process of its own). Then the accounting: every 202 job's
groups are in the buffer's job stream, exactly once (`jobs accounted`), and no 5xx other than
the 503 + Retry-After of load shedding happened.

    python benchmarks/load_rollout.py --rates 50,200,500,1000,2000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(
    0, str(ROOT / "tests")
)  # the in-thread test servers: tests/engine_server.py, rollout_server.py

from rollout_server import start_process, start_reward_service

from asyncrl.buffer import AdmissionControl, Buffer, Jobs
from asyncrl.buffer.server import RedisServer, free_port
from asyncrl.services.ops.tinymodel import build_tiny_model


@dataclass
class RateResult:
    offered: float
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0  # no HTTP answer at all (connection refused, timeout)
    health_worst_s: float = 0.0
    wall_s: float = 0.0  # first scheduled send to last answer
    accepted: dict[str, int] = field(default_factory=dict)  # job_id -> groups

    def row(self) -> dict:
        lat = sorted(self.latencies)
        answered = sum(self.statuses.values())

        def q(p: float) -> float:
            return lat[min(int(p * len(lat)), len(lat) - 1)] * 1000 if lat else float("nan")

        return {
            "offered_jobs_per_s": self.offered,
            "answered": answered,
            "wall_s": round(self.wall_s, 1),
            "achieved_jobs_per_s": round(
                answered / max(self.wall_s, 1e-9), 1
            ),  # what the service kept up with
            "accepted": self.statuses.get(202, 0),
            "p50_ms": round(q(0.50), 1),
            "p99_ms": round(q(0.99), 1),
            "statuses": dict(sorted(self.statuses.items())),
            "no_answer": self.errors,
            "health_worst_ms": round(self.health_worst_s * 1000, 1),
        }


# The health probe runs in a process of its own: in the load generator's event loop it would
# measure the generator's own backlog. It probes every 100 ms until told to stop on stdin and
# prints its worst latency in seconds.
PROBE = """
import sys, threading, time, httpx
worst, done = 0.0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
with httpx.Client(base_url=sys.argv[1], timeout=60) as c:
    while not done.wait(0.1):
        t0 = time.perf_counter()
        try:
            c.get("/healthz")
        except httpx.HTTPError:
            pass
        worst = max(worst, time.perf_counter() - t0)
print(worst)
"""


def body(i: int, prompts: int, tag: str) -> dict:
    letters = "abcdefghij"
    return {
        "prompts": [
            {"text": "".join(letters[(i * 7 + k * 3 + j) % 10] for j in range(4)) + ">"}
            for k in range(prompts)
        ],
        "group_size": 4,
        "reward_spec": {"verifier": "reverse"},
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
        "idempotency_key": f"{tag}-{i}",
    }


async def run_rate(
    url: str, rate: float, seconds: float, prompts: int, tag: str, timeout_s: float
) -> RateResult:
    res = RateResult(offered=rate, seconds=seconds)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one(i: int, due: float) -> None:
            await asyncio.sleep(max(due - time.perf_counter(), 0))
            try:
                resp = await client.post("/v1/rollouts", json=body(i, prompts, tag))
            except httpx.HTTPError:
                res.errors += 1
                return
            res.latencies.append(time.perf_counter() - due)
            res.statuses[resp.status_code] = res.statuses.get(resp.status_code, 0) + 1
            if resp.status_code == 202:
                out = resp.json()
                res.accepted[out["job_id"]] = out["groups"]

        prober = await asyncio.create_subprocess_exec(sys.executable, "-c", PROBE, url, stdin=asyncio.subprocess.PIPE,
                                                      stdout=asyncio.subprocess.PIPE)  # fmt: skip
        start = time.perf_counter() + 0.2
        n = int(rate * seconds)
        await asyncio.gather(*(one(i, start + i / rate) for i in range(n)))
        res.wall_s = time.perf_counter() - start
        out, _ = await asyncio.wait_for(prober.communicate(b"stop\n"), timeout=120)
        res.health_worst_s = float(out.decode().strip() or "nan")
    return res


def account(redis_url: str, run: str, results: list[RateResult]) -> dict:
    """Every accepted job's groups in the job stream exactly once, and its progress says so."""
    buf = Buffer(redis_url, run)
    expected = sum(g for r in results for g in r.accepted.values())
    in_stream = buf.redis.xlen(buf.keys.jobs)
    indexed = buf.redis.hlen(buf.keys.job_state)
    jobs = [j for r in results for j in r.accepted]
    recorded = sum(p.groups for j in jobs if (p := Jobs(buf).progress(j)) is not None)
    return {"groups_accepted": expected, "groups_in_job_stream": in_stream, "groups_indexed": indexed,
            "groups_recorded_in_jobs": recorded, "jobs_accepted": len(jobs),
            "exact": expected == in_stream == indexed == recorded}  # fmt: skip


@contextlib.contextmanager
def topology(tmp: Path):
    """redis-server, reward service and rollout service (no engine); yields (rollout url, redis url, run)."""
    redis = RedisServer(tmp / "redis").start()
    model = tmp / "tiny"
    build_tiny_model(model, seed=0, max_position_embeddings=64)
    reward = start_reward_service(log_path=tmp / "reward.log")
    port, run = free_port(), "load"
    AdmissionControl(Buffer(redis.url, run)).configure(batch_groups=64, max_staleness=0)
    try:
        rollout = start_process(
            [sys.executable, "-m", "asyncrl.services.ops.cli", "rollout", "--port", str(port), "--redis-url", redis.url,
             "--run", run, "--replica", "load", "--engine-urls", "http://127.0.0.1:9", "--reward-url", reward.url,
             "--tokenizer", str(model), "--engine-backoff-s", "1.0"],
            f"http://127.0.0.1:{port}", "/healthz", log_path=tmp / "rollout.log")  # fmt: skip
        try:
            yield rollout.url, redis.url, run
        finally:
            rollout.stop()
    finally:
        reward.stop()
        redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,200,500,1000,2000", help="offered jobs/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prompts", type=int, default=1, help="prompts (groups) per job")
    ap.add_argument("--timeout", type=float, default=30.0, help="client timeout per request, s")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp, topology(Path(tmp)) as (url, redis_url, run):
        for k, rate in enumerate(float(r) for r in args.rates.split(",")):
            r = asyncio.run(run_rate(url, rate, args.seconds, args.prompts, f"r{k}", args.timeout))
            results.append(r)
            print(json.dumps(r.row()), flush=True)
        acc = account(redis_url, run, results)
        print(json.dumps(acc), flush=True)
    # 503 + Retry-After is the service shedding load on purpose (InflightLimit); any other 5xx fails
    fives = sum(c for r in results for s, c in r.statuses.items() if s >= 500 and s != 503)
    shed = sum(r.statuses.get(503, 0) for r in results)
    summary = {
        "rates": [r.row() for r in results],
        "accounting": acc,
        "5xx_not_shed": fives,
        "shed_503": shed,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    if fives or not acc["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
