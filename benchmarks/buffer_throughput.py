"""Buffer throughput: groups of 8 samples × 2,048 completion tokens through `Groups.put` /
`take` / `ack`, next to raw pipelined XADD / XREADGROUP / XACK of the same bytes, in the same
run against the same private redis-server. Reports groups/s, MB/s and the ratio.

Two arrangements, each for both paths:
* sequential: one process puts every group, then takes them all (one client does both sides);
* processes: a producer process puts while a consumer process takes, as the rollout service
  and the trainer do; the time runs from a common start to the consumer's last ack.
Each also reports the CPU spent per group by the clients and by redis-server (`INFO cpu`).
One untimed round of every path comes first (redis-server and the allocators warm up: the
first round ran 20-50% slower than the rest on these machines). A diagnostic row times the
payload fetch alone: redis-py's MGET (with hiredis's parser when it is installed).

    .venv/bin/python benchmarks/buffer_throughput.py [--groups 400] [--repeats 5] [--mode both]
        [--codec-removed]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import redis.utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.buffer import Buffer, Groups, RedisServer
from asyncrl.buffer.malloc_tuning import tune_malloc
from asyncrl.proto import Group, RewardStatus, Sample, encode

SAMPLES, TOKENS = 8, 2048


def make_groups(n: int) -> list[Group]:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n):
        samples = [
            Sample(
                prompt_id=f"p{g}",
                index=i,
                completion_ids=rng.integers(0, 150_000, TOKENS, dtype=np.int32),
                behavior_logprobs=-rng.random(TOKENS, dtype=np.float32),
                versions=np.full(TOKENS, 3, dtype=np.int32),
                finish_reason="length",
                reward=1.0,
                reward_status=RewardStatus.scored,
            )
            for i in range(SAMPLES)
        ]
        groups.append(Group.build(group_id=f"g{g}", job_id="bench", prompt_tokens=rng.integers(0, 150_000, 256, dtype=np.int32),
                                  reward_spec={"verifier": "math", "answer": "42"}, samples=samples, submit_version=3))  # fmt: skip
    return groups


def gather_seconds(groups: list[Group]) -> float:
    """What the producer pays before `Groups.put`: building each group from its `Sample`s (as
    the rollout service does), which gathers their arrays into the group's columns."""
    rows = [list(g.samples) for g in groups]
    t0 = time.perf_counter()
    for g, samples in zip(groups, rows):
        Group.build(group_id=g.group_id, job_id=g.job_id, prompt_tokens=g.prompt_tokens, reward_spec=g.reward_spec,
                    samples=samples, submit_version=g.submit_version)  # fmt: skip
    return time.perf_counter() - t0


def buffer_put(buf: Groups, groups: list[Group], batch: int) -> None:
    """One round trip per `batch` groups, like the raw pipeline."""
    for i in range(0, len(groups), batch):
        buf.put(groups[i : i + batch])


def buffer_take(buf: Groups, n: int, batch: int) -> None:
    taken = 0
    while taken < n:
        # `take` waits up to block_ms to fill n; ask only for what is left, like the raw loop.
        res = buf.take(min(batch, n - taken), current_version=3, max_staleness=0, block_ms=1000)
        buf.ack([g.group_id for g in res.groups])
        taken += len(res.groups)


def raw_put(r, stream: str, payloads: list[bytes], batch: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i, p in enumerate(payloads):
        pipe.xadd(stream, {"gid": f"g{i}", "data": p})
        if len(pipe) >= batch:
            pipe.execute()
    pipe.execute()


def raw_take(r, stream: str, n: int, batch: int) -> None:
    taken = 0
    while taken < n:
        resp = r.xreadgroup("trainer", "bench", {stream: ">"}, count=min(batch, n - taken), block=1000)
        ids = [eid for eid, _ in resp[0][1]] if resp else []
        if ids:
            r.pipeline(transaction=False).xack(stream, "trainer", *ids).xdel(stream, *ids).execute()
        taken += len(ids)


def run_buffer(url: str, run: str, groups: list[Group], batch: int, pipelined: bool) -> float:
    buf = Groups(Buffer(url, run), "bench")
    t0 = time.perf_counter()
    if pipelined:
        buffer_put(buf, groups, batch)
    else:
        for g in groups:
            buf.put([g])
    buffer_take(buf, len(groups), batch)
    elapsed = time.perf_counter() - t0
    buf.buf.close()
    return elapsed


def raw_stream(url: str, run: str, create: bool = False):
    r = redis.Redis.from_url(url)
    stream = f"raw:{{{run}}}:groups"
    if create:
        r.xgroup_create(stream, "trainer", id="0", mkstream=True)
    return r, stream


def run_raw(url: str, run: str, payloads: list[bytes], batch: int) -> float:
    r, stream = raw_stream(url, run, create=True)
    t0 = time.perf_counter()
    raw_put(r, stream, payloads, batch)
    raw_take(r, stream, len(payloads), batch)
    elapsed = time.perf_counter() - t0
    r.close()
    return elapsed


def server_cpu(url: str) -> float:
    with redis.Redis.from_url(url) as r:
        info = r.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def producer(url: str, run: str, kind: str, n: int, batch: int, start, out) -> None:
    """Child process: build (and for raw, encode) the groups, then push them after `start`."""
    tune_malloc()
    groups = make_groups(n)
    if kind == "raw":
        payloads = [encode(g) for g in groups]
        r, stream = raw_stream(url, run)
        start.wait()
        c0 = time.process_time()
        raw_put(r, stream, payloads, batch)
    else:
        buf = Groups(Buffer(url, run), "producer")
        start.wait()
        c0 = time.process_time()
        buffer_put(buf, groups, batch)
    out.put(("producer", time.process_time() - c0))


def consumer(url: str, run: str, kind: str, n: int, batch: int, start, out) -> None:
    """Child process: take and ack `n` groups after `start`; reports the wall time to the last ack."""
    tune_malloc()
    if kind == "raw":
        r, stream = raw_stream(url, run)
        start.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        raw_take(r, stream, n, batch)
    else:
        buf = Groups(Buffer(url, run), "consumer")
        start.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        buffer_take(buf, n, batch)
    out.put(("consumer", time.process_time() - c0, time.perf_counter() - t0))


def run_processes(url: str, run: str, kind: str, n: int, batch: int) -> tuple[float, float, float]:
    """(wall s, client CPU s, server CPU s) with a producer and a consumer process."""
    ctx = mp.get_context("spawn")
    if kind == "raw":
        raw_stream(url, run, create=True)[0].close()
    else:
        Buffer(url, run).close()  # creates the streams and groups
    start, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=f, args=(url, run, kind, n, batch, start, out)) for f in (producer, consumer)]
    for p in procs:
        p.start()
    s0 = server_cpu(url)
    start.wait()
    results = {msg[0]: msg[1:] for msg in (out.get(timeout=600) for _ in procs)}
    s1 = server_cpu(url)
    for p in procs:
        p.join()
    (producer_cpu,), (consumer_cpu, wall) = results["producer"], results["consumer"]
    return wall, producer_cpu + consumer_cpu, s1 - s0


@contextlib.contextmanager
def codec_removed(groups: list[Group], payloads: list[bytes]):
    """Diagnostic: the buffer's own protocol cost. Inside, the buffer's `encode` hands back the
    precomputed payload and its `decode` the prebuilt group (found by the payload's first KB,
    which holds random completion tokens), so what is left is Lua, round trips and bookkeeping."""
    from asyncrl.buffer import groups as part

    by_group = {id(g): p for g, p in zip(groups, payloads)}
    by_head = {bytes(p[:1024]): g for g, p in zip(groups, payloads)}
    real_encode, real_decode = part.encode, part.decode
    part.encode = lambda record: by_group[id(record)]
    part.decode = lambda data, cls=None: (
        by_head[bytes(data[:1024])] if cls is Group else real_decode(data, cls)
    )
    try:
        yield
    finally:
        part.encode, part.decode = real_encode, real_decode


def fetch_seconds(url: str, payloads: list[bytes], batch: int, repeats: int) -> float:
    """Median seconds to fetch every payload, `batch` keys per MGET, as `Groups.take` does."""
    r = redis.Redis.from_url(url)
    keys = [f"fetch:{{bench}}:{i}" for i in range(len(payloads))]
    r.mset(dict(zip(keys, payloads)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(keys), batch):
            r.mget(keys[i : i + batch])
        times.append(time.perf_counter() - t0)
    r.delete(*keys)
    r.close()
    return statistics.median(times)


def timed(url: str, fn, *args) -> tuple[float, float, float]:
    """(wall s, client CPU s, server CPU s) of one sequential run."""
    s0, c0 = server_cpu(url), time.process_time()
    wall = fn(url, *args)
    return wall, time.process_time() - c0, server_cpu(url) - s0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16, help="groups per take / per raw pipeline")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=("sequential", "processes", "both"), default="both")
    ap.add_argument(
        "--codec-removed",
        action="store_true",
        help="also run the sequential buffer path with encode/decode replaced by lookups (diagnostic)",
    )
    args = ap.parse_args()

    # The buffer tunes glibc's allocator for large payloads on first use (buffer/malloc_tuning.py); apply it
    # up front so the raw path runs under the same allocator settings.
    malloc_tuned = tune_malloc()
    groups = make_groups(args.groups)
    payloads = [encode(g) for g in groups]
    gather = gather_seconds(groups)
    mb = sum(map(len, payloads)) / 1e6
    n = args.groups
    runs: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(d, appendonly=False).start()
        try:
            for rep in range(-1, args.repeats):  # interleaved, so drift hits both alike; round -1 warms up
                if args.mode in ("sequential", "both"):
                    runs.setdefault("raw", []).append(
                        timed(server.url, run_raw, f"raw{rep}", payloads, args.batch)
                    )
                    runs.setdefault("buf", []).append(
                        timed(server.url, run_buffer, f"buf{rep}", groups, args.batch, True)
                    )
                    if args.codec_removed:
                        with codec_removed(groups, payloads):
                            runs.setdefault("nocodec", []).append(
                                timed(server.url, run_buffer, f"nocodec{rep}", groups, args.batch, True)
                            )
                    runs.setdefault("one", []).append(
                        timed(server.url, run_buffer, f"one{rep}", groups, args.batch, False)
                    )
                if args.mode in ("processes", "both"):
                    runs.setdefault("praw", []).append(
                        run_processes(server.url, f"praw{rep}", "raw", n, args.batch)
                    )
                    runs.setdefault("pbuf", []).append(
                        run_processes(server.url, f"pbuf{rep}", "buf", n, args.batch)
                    )
                if rep < 0:
                    runs.clear()
            fetch = fetch_seconds(server.url, payloads, args.batch, args.repeats)
        finally:
            server.stop()
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in runs.items()}
    print(f"groups of {SAMPLES} samples x {TOKENS} tokens, {n} groups, {mb / n:.3f} MB/group, "
          f"median of {args.repeats}, malloc tuned for both: {malloc_tuned}")  # fmt: skip
    print(f"outside both paths, in the producer: Group.build gathering {SAMPLES} Samples into columns, "
          f"{gather / n * 1e6:,.0f} µs/group")  # fmt: skip
    print("| arrangement | path | groups/s | MB/s | client CPU µs/group | redis-server CPU µs/group |")
    print("|---|---|---|---|---|---|")
    names = {"buf": ("sequential", "buffer put (batches) + take + ack"),
             "nocodec": ("sequential", "buffer put (batches) + take + ack, codec removed (diagnostic)"),
             "one": ("sequential", "buffer put one by one + take + ack"),
             "raw": ("sequential", "raw pipelined XADD + XREADGROUP + XACK (same bytes)"),
             "pbuf": ("processes", "buffer put (batches), in parallel take + ack"),
             "praw": ("processes", "raw pipelined XADD, in parallel XREADGROUP + XACK (same bytes)")}  # fmt: skip
    for key, (arrangement, label) in names.items():
        if key in med:
            wall, client, srv = med[key]
            print(f"| {arrangement} | {label} | {n / wall:,.0f} | {mb / wall:,.0f} | {client / n * 1e6:,.0f} | "
                  f"{srv / n * 1e6:,.0f} |")  # fmt: skip
    parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure Python"
    print(
        f"| diagnostic | payload fetch alone, redis-py MGET ({parser} parser) | {n / fetch:,.0f} | {mb / fetch:,.0f} | | |"
    )
    print()
    for key, raw, label in (("buf", "raw", "sequential, put in batches"), ("one", "raw", "sequential, put one by one"),
                            ("nocodec", "raw", "sequential, put in batches, codec removed"),
                            ("pbuf", "praw", "processes, put in batches")):  # fmt: skip
        if key in med:
            rounds = " ".join(f"{r[0] / b[0]:.2f}" for r, b in zip(runs[raw], runs[key]))
            print(f"ratio buffer / raw ({label}): {med[raw][0] / med[key][0]:.2f} (target >= 0.80); "
                  f"round by round: {rounds}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
