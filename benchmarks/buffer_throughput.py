"""Buffer throughput: groups of 8 samples × 2,048 completion tokens through `Groups.put` /
`take` / `ack`, next to a plain Redis stream of the same groups, in the same run against the
same private redis-server. Reports groups/s, MB/s and the ratios.

The baseline (`raw + codec`) is the least a correct transport of groups does without the
buffer's logic: the producer encodes each group with the records' codec (`proto.encode`, the
same bytes the buffer stores) and XADDs it, pipelined, one round trip per batch; the consumer
XREADGROUPs a batch, decodes each payload (`proto.decode`, the same validation the buffer
runs) and XACKs + XDELs the batch in one round trip. Under `--aof always` its puts are
MULTI/EXEC, as the buffer's are (`raw_put`). It has no idempotent put, no group states, no
admission or staleness accounting and no dead letters: what is left between it and the
buffer is those. A second row, `raw bytes`, moves the pre-encoded payloads and never decodes
them (the earlier baseline): it bounds what any transport of bytes could do, and its ratio is
kept for comparison with earlier figures.

Two arrangements, each for the buffer and both baselines:
* sequential: one process puts every group, then takes them all (one client does both sides);
* processes: a producer process puts while a consumer process takes, as the rollout service
  and the trainer do; the time runs from a common start to the consumer's last ack (each
  encodes inside its timed part, except `raw bytes`, whose payloads are encoded before).
Each also reports the CPU spent per group by the clients and by redis-server (`INFO cpu`).
One untimed round of every path comes first (redis-server and the allocators warm up: the
first round ran 20-50% slower than the rest on these machines). A diagnostic row times the
payload fetch alone: redis-py's MGET (with hiredis's parser when it is installed). `--aof`
gives the server an append-only file (`always`: fsync before every reply, as the embedded
Redis, compose and k8s run it); both paths share the server, so both get the same persistence.

    .venv/bin/python benchmarks/buffer_throughput.py [--groups 400] [--repeats 5] [--mode both]
        [--aof off|everysec|always] [--codec-removed]
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
from asyncrl.proto import Group, RewardStatus, Sample, decode, encode

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


def raw_put(r, stream: str, items: list[Group] | list[bytes], batch: int, transaction: bool) -> None:
    """XADD each item, `batch` per pipeline; a `Group` is encoded here (`raw + codec`).
    `transaction` (main() sets it under `--aof always`) makes each pipeline one MULTI/EXEC, as
    the buffer's put is: applied in one event-loop turn, one fsync per batch instead of one or
    two per entry. Without an fsync per write it is left off: MULTI costs XADD ~10% there (the
    server no longer works while the client still sends)."""
    pipe = r.pipeline(transaction=transaction)
    for i, item in enumerate(items):
        pipe.xadd(stream, {"gid": f"g{i}", "data": item if isinstance(item, bytes) else encode(item)})
        if len(pipe) >= batch:
            pipe.execute()
    pipe.execute()


def raw_take(r, stream: str, n: int, batch: int, codec: bool) -> None:
    """XREADGROUP up to `batch`, decode each payload into a `Group` if `codec`, then XACK +
    XDEL the batch in one round trip."""
    taken = 0
    while taken < n:
        resp = r.xreadgroup("trainer", "bench", {stream: ">"}, count=min(batch, n - taken), block=1000)
        entries = resp[0][1] if resp else []
        if codec:
            for _, fields in entries:
                decode(fields[b"data"], Group)
        ids = [eid for eid, _ in entries]
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


def run_raw(url: str, run: str, items: list[Group] | list[bytes], batch: int, transaction: bool) -> float:
    r, stream = raw_stream(url, run, create=True)
    t0 = time.perf_counter()
    raw_put(r, stream, items, batch, transaction)
    raw_take(r, stream, len(items), batch, codec=not isinstance(items[0], bytes))
    elapsed = time.perf_counter() - t0
    r.close()
    return elapsed


def server_cpu(url: str) -> float:
    with redis.Redis.from_url(url) as r:
        info = r.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def producer(url: str, run: str, kind: str, n: int, batch: int, transaction: bool, start, out) -> None:
    """Child process: build the groups (for `raw` also encode them), then push them after `start`."""
    tune_malloc()
    groups = make_groups(n)
    if kind in ("raw", "rawc"):
        items = [encode(g) for g in groups] if kind == "raw" else groups
        r, stream = raw_stream(url, run)
        start.wait()
        c0 = time.process_time()
        raw_put(r, stream, items, batch, transaction)
    else:
        buf = Groups(Buffer(url, run), "producer")
        start.wait()
        c0 = time.process_time()
        buffer_put(buf, groups, batch)
    out.put(("producer", time.process_time() - c0))


def consumer(url: str, run: str, kind: str, n: int, batch: int, start, out) -> None:
    """Child process: take and ack `n` groups after `start`; reports the wall time to the last ack."""
    tune_malloc()
    if kind in ("raw", "rawc"):
        r, stream = raw_stream(url, run)
        start.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        raw_take(r, stream, n, batch, codec=kind == "rawc")
    else:
        buf = Groups(Buffer(url, run), "consumer")
        start.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        buffer_take(buf, n, batch)
    out.put(("consumer", time.process_time() - c0, time.perf_counter() - t0))


def run_processes(
    url: str, run: str, kind: str, n: int, batch: int, transaction: bool
) -> tuple[float, float, float]:
    """(wall s, client CPU s, server CPU s) with a producer and a consumer process."""
    ctx = mp.get_context("spawn")
    if kind in ("raw", "rawc"):
        raw_stream(url, run, create=True)[0].close()
    else:
        Buffer(url, run).close()  # creates the streams and groups
    start, out = ctx.Barrier(3), ctx.Queue()
    procs = [
        ctx.Process(target=producer, args=(url, run, kind, n, batch, transaction, start, out)),
        ctx.Process(target=consumer, args=(url, run, kind, n, batch, start, out)),
    ]
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


LABELS = {  # key: (arrangement, path)
    "buf": ("sequential", "buffer put (batches) + take + ack"),
    "nocodec": ("sequential", "buffer put (batches) + take + ack, codec removed (diagnostic)"),
    "one": ("sequential", "buffer put one by one + take + ack"),
    "rawc": ("sequential", "raw + codec: encode, pipelined XADD; XREADGROUP, decode, XACK + XDEL"),
    "raw": ("sequential", "raw bytes: pipelined XADD + XREADGROUP + XACK + XDEL of pre-encoded payloads"),
    "pbuf": ("processes", "buffer put (batches), in parallel take + ack"),
    "prawc": ("processes", "raw + codec, in parallel"),
    "praw": ("processes", "raw bytes, in parallel"),
}
RATIOS = (  # buffer key, baseline key, what; the target applies to the raw + codec baseline
    ("buf", "rawc", "buffer / (raw + codec), sequential, put in batches"),
    ("pbuf", "prawc", "buffer / (raw + codec), processes, put in batches"),
    ("one", "rawc", "buffer / (raw + codec), sequential, put one by one"),
    ("buf", "raw", "buffer / raw bytes, sequential, put in batches (earlier baseline)"),
    ("pbuf", "praw", "buffer / raw bytes, processes, put in batches (earlier baseline)"),
    ("nocodec", "raw", "buffer with codec removed / raw bytes, sequential"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16, help="groups per take / per raw pipeline")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", choices=("sequential", "processes", "both"), default="both")
    ap.add_argument(
        "--aof",
        choices=("off", "everysec", "always"),
        default="off",
        help="the server's append-only file and its fsync policy (both paths share the server)",
    )
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

    def add(key: str, result: tuple[float, float, float]) -> None:
        runs.setdefault(key, []).append(result)

    with tempfile.TemporaryDirectory() as d:
        fsync = "everysec" if args.aof == "off" else args.aof
        server = RedisServer(d, appendonly=args.aof != "off", fsync=fsync).start()
        # No AOF rewrites mid-run: a rewrite forks and copies on these 2 cores, slowing whichever
        # path runs then (the bytes it rewrites are the same for every path).
        with redis.Redis.from_url(server.url) as r:
            r.config_set("auto-aof-rewrite-percentage", 0)
        tx = args.aof == "always"  # the raw puts as MULTI/EXEC (`raw_put`)
        try:
            for rep in range(-1, args.repeats):  # interleaved, so drift hits all alike; round -1 warms up
                if args.mode in ("sequential", "both"):
                    add("raw", timed(server.url, run_raw, f"raw{rep}", payloads, args.batch, tx))
                    add("rawc", timed(server.url, run_raw, f"rawc{rep}", groups, args.batch, tx))
                    add("buf", timed(server.url, run_buffer, f"buf{rep}", groups, args.batch, True))
                    if args.codec_removed:
                        with codec_removed(groups, payloads):
                            add(
                                "nocodec",
                                timed(server.url, run_buffer, f"nocodec{rep}", groups, args.batch, True),
                            )
                    add("one", timed(server.url, run_buffer, f"one{rep}", groups, args.batch, False))
                if args.mode in ("processes", "both"):
                    for key, kind in (("praw", "raw"), ("prawc", "rawc"), ("pbuf", "buf")):
                        add(key, run_processes(server.url, f"{key}{rep}", kind, n, args.batch, tx))
                if rep < 0:
                    runs.clear()
            fetch = fetch_seconds(server.url, payloads, args.batch, args.repeats)
        finally:
            server.stop()
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in runs.items()}
    aof = "no AOF" if args.aof == "off" else f"AOF, appendfsync {args.aof}"
    print(f"groups of {SAMPLES} samples x {TOKENS} tokens, {n} groups, {mb / n:.3f} MB/group, "
          f"median of {args.repeats}, redis-server with {aof}, malloc tuned for all: {malloc_tuned}")  # fmt: skip
    print(f"outside every path, in the producer: Group.build gathering {SAMPLES} Samples into columns, "
          f"{gather / n * 1e6:,.0f} µs/group")  # fmt: skip
    print("| arrangement | path | groups/s | MB/s | client CPU µs/group | redis-server CPU µs/group |")
    print("|---|---|---|---|---|---|")
    for key, (arrangement, label) in LABELS.items():
        if key in med:
            wall, client, srv = med[key]
            print(f"| {arrangement} | {label} | {n / wall:,.0f} | {mb / wall:,.0f} | {client / n * 1e6:,.0f} | "
                  f"{srv / n * 1e6:,.0f} |")  # fmt: skip
    parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure Python"
    print(
        f"| diagnostic | payload fetch alone, redis-py MGET ({parser} parser) | {n / fetch:,.0f} | {mb / fetch:,.0f} | | |"
    )
    print()
    for key, base, label in RATIOS:
        if key in med:
            rounds = " ".join(f"{r[0] / b[0]:.2f}" for r, b in zip(runs[base], runs[key]))
            target = " (target >= 0.80)" if base in ("rawc", "prawc") and key != "one" else ""
            # CPU of clients and redis-server per group: steadier than wall time on a shared machine
            cpu = (med[base][1] + med[base][2]) / (med[key][1] + med[key][2])
            print(f"ratio {label}: {med[base][0] / med[key][0]:.2f}{target}; round by round: {rounds}; "
                  f"CPU per group, baseline / buffer: {cpu:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
