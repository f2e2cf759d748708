"""Buffer throughput on one Redis vs a 3-master Redis Cluster (3 + 3 replicas), in one run,
paired: the same groups (8 samples × 2,048 completion tokens, as benchmarks/buffer_throughput.py)
through `Groups.put` then `take` + `ack`, in batches, against

* `1 node`: one redis-server (AOF, `appendfsync always`, like the embedded server);
* `cluster`: buffer/local_cluster.py, every node `appendfsync always`, each write confirmed by a
  replica (`WAIT 1`, the URL's default);
* `cluster, no WAIT`: the same cluster with `?replicas=0`, to show what the replica wait costs.

The arrangements alternate within each repeat (1 node, cluster, cluster no WAIT, …) so a noisy
neighbour hits all three alike; reported: median groups/s and MB/s of payload for put, for
take+ack, and for both, and each cluster row's ratio to the 1-node one. All the processes share
this machine's cores: the cluster's masters do not get cores of their own, so this measures the
client path's cost, not the cluster's capacity (that needs one host per master).

    .venv/bin/python benchmarks/buffer_cluster.py [--groups 200] [--batch 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from buffer_throughput import make_groups

from asyncrl.buffer import Buffer, Groups, RedisServer
from asyncrl.buffer.local_cluster import LocalCluster
from asyncrl.proto import encode


def one_round(url: str, groups, batch: int) -> tuple[float, float]:
    """Seconds to put every group, then to take and ack them all."""
    buf = Groups(Buffer(url, f"b{uuid.uuid4().hex[:8]}"), "bench")
    t0 = time.perf_counter()
    for i in range(0, len(groups), batch):
        buf.put(groups[i : i + batch])
    t1 = time.perf_counter()
    taken = 0
    while taken < len(groups):
        res = buf.take(min(batch, len(groups) - taken), current_version=3, max_staleness=0, block_ms=1000)
        buf.ack([g.group_id for g in res.groups])
        taken += len(res.groups)
    t2 = time.perf_counter()
    buf.buf.close()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    groups = make_groups(args.groups)
    mb = sum(len(encode(g)) for g in groups) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        single = RedisServer(Path(tmp) / "single", fsync="always").start()
        with LocalCluster(Path(tmp) / "cluster") as cluster:
            urls = {
                "1 node": single.url,
                "cluster": cluster.url,
                "cluster, no WAIT": cluster.url + "?replicas=0",
            }
            for url in urls.values():  # untimed warm-up round
                one_round(url, groups[: args.batch * 2], args.batch)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
            for _ in range(args.repeats):
                for name, url in urls.items():
                    times[name].append(one_round(url, groups, args.batch))
            spread = dict.fromkeys(cluster.masters(), 0)
            probe = Buffer(cluster.url, "probe")
            for g in groups:
                spread[cluster.owner(probe.payload_key(g.group_id))] += 1
            probe.close()
        single.stop()
    print(f"{args.groups} groups, {mb:.1f} MB of payload, batches of {args.batch}, {args.repeats} repeats")
    print(f"payloads per master (the cluster spreads them): {sorted(spread.values())}")
    print(
        f"{'':18} {'put g/s':>8} {'put MB/s':>9} {'take+ack g/s':>13} {'both g/s':>9} {'both MB/s':>10} {'ratio':>6}"
    )
    base = None
    for name, rounds in times.items():
        put = statistics.median(p for p, _ in rounds)
        take = statistics.median(t for _, t in rounds)
        both = statistics.median(p + t for p, t in rounds)
        base = base or both
        print(
            f"{name:18} {args.groups / put:8.0f} {mb / put:9.1f} {args.groups / take:13.0f} "
            f"{args.groups / both:9.0f} {mb / both:10.1f} {base / both:6.2f}"
        )


if __name__ == "__main__":
    main()
