"""Worker functions run in separate processes by test_buffer.py (spawned, so importable)."""

from __future__ import annotations

import json
import time

from asyncrl.buffer import AdmissionControl, Buffer, Groups


def consume(url: str, run: str, consumer: str, out_path: str, batch: int, idle_s: float) -> None:
    """Take groups until none arrive for idle_s; ack each batch; record what was received."""
    groups = Groups(Buffer(url, run), consumer)
    groups.buf.redis.xgroup_createconsumer(
        groups.keys.groups, "trainer", consumer
    )  # visible to the producer's wait
    got: list[str] = []
    last = time.monotonic()
    while time.monotonic() - last < idle_s:
        res = groups.take(batch, current_version=0, max_staleness=0, block_ms=100)
        if res.groups:
            ids = [g.group_id for g in res.groups]
            got += ids
            groups.ack(ids)
            last = time.monotonic()
    with open(out_path, "w") as f:
        json.dump(got, f)


def take_and_hang(url: str, run: str, consumer: str, out_path: str, n: int) -> None:
    """Take n groups without acking, report them, then wait to be SIGKILLed mid-batch."""
    res = Groups(Buffer(url, run), consumer).take(n, current_version=0, max_staleness=0, block_ms=5000)
    with open(out_path, "w") as f:
        json.dump([g.group_id for g in res.groups], f)
    time.sleep(600)  # not synchronisation: it hangs here until the test kills it


def admit(url: str, run: str, worker: int, attempts: int, start, out_path: str) -> None:
    """Connect, wait at the `start` barrier for every other worker, then try to admit."""
    admission = AdmissionControl(Buffer(url, run))
    start.wait()
    admitted = [f"w{worker}-{i}" for i in range(attempts) if admission.try_admit(f"w{worker}-{i}").go]
    with open(out_path, "w") as f:
        json.dump(admitted, f)
