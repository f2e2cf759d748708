"""Buffer throughput: groups of 8 samples × 2,048 completion tokens through `put_group` /
`take_groups` / `ack`, next to raw pipelined XADD / XREADGROUP / XACK of the same bytes, in
the same run against the same private redis-server. Reports groups/s, MB/s and the ratio.

    .venv/bin/python benchmarks/buffer_throughput.py [--groups 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer import RedisServer, ReplayBuffer
from buffer.alloc import tune_malloc
from proto import Group, RewardStatus, Sample, encode

SAMPLES, TOKENS = 8, 2048


def make_groups(n: int) -> list[Group]:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n):
        samples = [
            Sample(
                prompt_id=f"p{g}", index=i,
                completion_ids=rng.integers(0, 150_000, TOKENS, dtype=np.int32),
                behavior_logprobs=-rng.random(TOKENS, dtype=np.float32),
                versions=np.full(TOKENS, 3, dtype=np.int32),
                finish_reason="length", reward=1.0, reward_status=RewardStatus.scored,
            )
            for i in range(SAMPLES)
        ]
        groups.append(Group.build(group_id=f"g{g}", job_id="bench", prompt_ids=rng.integers(0, 150_000, 256, dtype=np.int32),
                                  reward_spec={"verifier": "math", "answer": "42"}, samples=samples, submit_version=3))  # fmt: skip
    return groups


def run_buffer(url: str, run: str, groups: list[Group], batch: int, pipelined: bool) -> float:
    buf = ReplayBuffer(url, run=run, consumer="bench")
    t0 = time.perf_counter()
    if pipelined:  # put_groups: one round trip per `batch` groups, like the raw pipeline
        for i in range(0, len(groups), batch):
            buf.put_groups(groups[i : i + batch])
    else:
        for g in groups:
            buf.put_group(g)
    taken = 0
    while taken < len(groups):
        # take_groups waits up to block_ms to fill n; ask only for what is left, like the raw loop.
        res = buf.take_groups(min(batch, len(groups) - taken), current_version=3, max_staleness=0, block_ms=1000)
        buf.ack([g.group_id for g in res.groups])
        taken += len(res.groups)
    elapsed = time.perf_counter() - t0
    buf.close()
    return elapsed


def run_raw(url: str, run: str, payloads: list[bytes], batch: int) -> float:
    import redis

    r = redis.Redis.from_url(url)
    stream = f"raw:{{{run}}}:groups"
    r.xgroup_create(stream, "trainer", id="0", mkstream=True)
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for i, p in enumerate(payloads):
        pipe.xadd(stream, {"gid": f"g{i}", "data": p})
        if len(pipe) >= batch:
            pipe.execute()
    pipe.execute()
    taken = 0
    while taken < len(payloads):
        resp = r.xreadgroup("trainer", "bench", {stream: ">"}, count=batch, block=1000)
        ids = [eid for eid, _ in resp[0][1]]
        r.pipeline(transaction=False).xack(stream, "trainer", *ids).xdel(stream, *ids).execute()
        taken += len(ids)
    elapsed = time.perf_counter() - t0
    r.close()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16, help="groups per take / per raw pipeline")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    # The buffer tunes glibc's allocator for large payloads on first use (buffer/alloc.py); apply it
    # up front so the raw path runs under the same allocator settings.
    malloc_tuned = tune_malloc()
    groups = make_groups(args.groups)
    payloads = [encode(g) for g in groups]
    mb = sum(map(len, payloads)) / 1e6
    buf_t, single_t, raw_t = [], [], []
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(d, appendonly=False).start()
        try:
            for rep in range(args.repeats):  # interleaved, so drift hits both alike
                raw_t.append(run_raw(server.url, f"raw{rep}", payloads, args.batch))
                buf_t.append(run_buffer(server.url, f"buf{rep}", groups, args.batch, pipelined=True))
                single_t.append(run_buffer(server.url, f"one{rep}", groups, args.batch, pipelined=False))
        finally:
            server.stop()
    b, one, r = statistics.median(buf_t), statistics.median(single_t), statistics.median(raw_t)
    print(f"groups of {SAMPLES} samples x {TOKENS} tokens, {args.groups} groups, {mb / args.groups:.3f} MB/group, "
          f"median of {args.repeats}, malloc tuned for both: {malloc_tuned}")  # fmt: skip
    print("| path | groups/s | MB/s |\n|---|---|---|")
    print(f"| buffer put_groups+take_groups+ack (encode, Lua, decode, validate) | {args.groups / b:,.0f} | {mb / b:,.0f} |")
    print(f"| buffer put_group one by one+take_groups+ack | {args.groups / one:,.0f} | {mb / one:,.0f} |")
    print(f"| raw pipelined XADD+XREADGROUP+XACK (same bytes) | {args.groups / r:,.0f} | {mb / r:,.0f} |")
    print(f"| ratio buffer (put_groups) / raw | {r / b:.2f} | target >= 0.80 |")
    print(f"| ratio buffer (put_group) / raw | {r / one:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
