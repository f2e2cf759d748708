"""`[trainer] core_share` through the trainer's own parts and loop (`trainer.parts.build` +
`trainer.loop.train_steps`, a one-rank gloo world in this process, the real Redis buffer): the
trainer joins the shared file as "trainer", gives up its cores while it waits for rollouts,
and computes its step on every core while no engine has work (none is in the file here; the
engine's side is tests/integration/engine/test_engine_core_share.py)."""

from __future__ import annotations

import fcntl
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from factories import make_group
from waiting import wait_until

from asyncrl.buffer import Buffer, Groups
from asyncrl.services.runtime.cores import BUSY_SECONDS, ROLES, SIZE, SLOT
from asyncrl.trainer.config import TrainerSettings

torch.set_num_threads(1)
B = 2
TOTAL = 2  # core_share_threads: what the trainer may use while the engine idles


def trainer_slot(path) -> tuple[int, int, int]:
    """The trainer's (pid, busy, claimed threads) in the shared file, read under a shared lock."""
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        data = f.read(SIZE)
    return SLOT.unpack_from(data, ROLES.index("trainer") * SLOT.size)


def test_the_trainer_rests_while_it_waits_and_trains_on_every_core(
    tiny, tmp_path, redis_url, run_id, one_rank
):
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.parts import build

    path, me = tmp_path / "cores", os.getpid()
    cfg = TrainerSettings(redis_url=redis_url, run=run_id, model_path=str(tiny), output_dir=str(tmp_path / "out"),
                          batch_groups=B, max_steps=1, checkpoint_every=100, metrics_port=0, device="cpu",
                          publish="disk", block_ms=100, core_share=str(path), core_share_threads=TOTAL)  # fmt: skip
    busy_2 = BUSY_SECONDS.labels("trainer", str(TOTAL))._value.get()
    # The trainer's home is the thread count it starts with (OMP_NUM_THREADS=1 under the launcher);
    # an earlier test in this worker process may have left torch's process-wide count at 2.
    torch.set_num_threads(1)
    # One thread builds and trains (torch's thread count is per thread: the test's own stays 1).
    with ThreadPoolExecutor(1) as trainer:
        parts = trainer.submit(build, cfg, one_rank).result()
        try:
            share = parts.cores
            assert (share.role, share.home, share.total) == ("trainer", 1, TOTAL)
            assert trainer_slot(path) == (me, 0, 0)
            # The model's decoder layers check in: a forward claims every core (no engine here).
            trainer.submit(parts.model, torch.tensor([[1, 5, 6, 7]])).result()
            assert trainer_slot(path) == (me, 1, TOTAL)
            assert trainer.submit(torch.get_num_threads).result() == TOTAL

            running = trainer.submit(train_steps, parts)
            # The buffer is empty: the trainer waits for rollouts and claims nothing meanwhile.
            wait_until(lambda: trainer_slot(path) == (me, 0, 0), message="the trainer rests while it waits")
            assert not running.done()
            Groups(Buffer(redis_url, run=run_id)).put([make_group(f"g{i}", seed=i) for i in range(B)])
            assert running.result(timeout=300) == 0
            # It trained its step busy on every core, and holds them at the end of it.
            assert trainer_slot(path) == (me, 1, TOTAL)
            assert trainer.submit(torch.get_num_threads).result() == TOTAL
            assert BUSY_SECONDS.labels("trainer", str(TOTAL))._value.get() > busy_2
        finally:
            parts.source.stop_requested.set()  # a loop still waiting for rollouts ends (a failed check)
    parts.cores.close()
    assert torch.get_num_threads() == 1  # the count is per thread: this one's is its own ...
    # ... but torch.set_num_threads also sets the count any thread takes up at its first parallel
    # op or get_num_threads (torch's lazy_init_num_threads): the trainer thread's last claim must
    # not reach the threads of later tests in this process.
    torch.set_num_threads(1)
