"""Helpers for the torch.distributed workers the trainer tests spawn."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


def finish_worker() -> None:
    """End a spawned worker whose process group is destroyed and whose results are written:
    exit now, without the interpreter's teardown. There torch's C++ threads can still race
    their destructors and abort a process that did all its work (SIGABRT, "terminate called
    without an active exception": seen once in a full-suite run of tests/integration/trainer/test_parity.py
    on rank 1; pytorch/pytorch#179291 describes the gloo case)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def gloo_rank(rank: int, world: int, port: int):
    """Join a `world`-rank gloo group on loopback as `rank`, with one torch thread; yields the
    trainer's `Dist` and destroys the group on the way out. Call `finish_worker()` after the
    block, so only a clean run exits 0."""
    import torch
    import torch.distributed as dist

    from asyncrl.trainer.model import init_distributed

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    d = init_distributed("cpu", timeout_s=120)
    try:
        yield d
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, target, *args, timeout_s: float = 300.0) -> None:
    """Spawn `target(rank, world, port, *args)` for every rank of a fresh world (a module-level
    function: spawn imports it) and wait for all; every rank must exit 0."""
    import multiprocessing as mp

    from asyncrl.buffer.server import free_port

    port, ctx = free_port(), mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
