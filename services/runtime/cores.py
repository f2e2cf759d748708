"""Core sharing between a CPU engine and the trainer on one machine (`[launch] core_share`).

On a small CPU machine the engine and the trainer each own one core, and each idles part of
the time: the engine once admission holds the next batch back, the trainer while it waits for
rollouts. A `CoreShare` lets whichever of the two is busy use the other's core while that one
is idle, and gives it back before the owner computes again, so two busy processes never spin
on one core (OpenMP barriers on an oversubscribed core collapse throughput).

The two parties meet in a 64-byte file (the launcher puts it in the run directory). Each has a
slot: its pid, whether it is busy, and how many torch threads it has claimed. Every change is
made under an exclusive `flock` of the file, so a read and the write that depends on it are
one step for the other party:

* `work()`: "I have work". An idle party marks itself busy, then waits until the other has
  handed back what it borrowed (at most `max_wait_s`; a dead or stuck peer cannot hold it
  longer, and each overrun is counted). A busy party re-checks: all the cores while the
  other is idle, its own (`home`) while the other is busy.
* `rest()`: "I have none": claims nothing until the next `work()`.

The thread count is applied with `torch.set_num_threads` on the calling thread. torch keeps
OpenMP's count per thread (a thread adopts the process-wide count, which `set_num_threads` also
sets, at its first parallel op), so each party calls these from the thread that runs its
forwards: the engine's scheduler thread, the trainer's main thread. Other threads of the process
(a weight-load or publish thread) run at the count last set. A party calls `work()` often while
it computes (the engine at each scheduler step; the trainer at each decoder layer's forward and
backward and after each step), which bounds how long the other waits for its core: one
scheduler step, one layer, or the LM head's or the optimizer's compute.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Literal

from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

Role = Literal["engine", "trainer"]
ROLES: tuple[Role, Role] = ("engine", "trainer")
SLOT = struct.Struct("<iii")  # pid, busy, claimed threads
SIZE = 64
POLL_S = 0.002

THREADS = Gauge("asyncrl_core_share_threads", "torch threads this process uses now (core sharing)", ["role"])
SWITCHES = Counter(
    "asyncrl_core_share_switches_total", "Changes of this process's torch thread count", ["role"]
)
WAIT_SECONDS = Counter(
    "asyncrl_core_share_wait_seconds_total",
    "Time spent waiting for the other process to hand back a borrowed core",
    ["role"],
)
WAIT_OVERRUNS = Counter(
    "asyncrl_core_share_wait_overruns_total",
    "Waits for a borrowed core that ran past max_wait_s (went ahead: the peer may be stuck)",
    ["role"],
)
BUSY_SECONDS = Counter(
    "asyncrl_core_share_busy_seconds_total",
    "Wall time this process had work, by threads used",
    ["role", "threads"],
)


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


class CoreShare:
    """One party's view of the shared file. Not thread-safe: one thread calls it."""

    def __init__(self, path: str | Path, role: Role, *, home: int = 1, total: int | None = None,
                 max_wait_s: float = 5.0) -> None:  # fmt: skip
        if role not in ROLES:
            raise ValueError(f"core share role must be one of {ROLES}, not {role!r}")
        self.role, self.home = role, home
        self.total = total if total is not None else cpu_count()
        if not 1 <= home <= self.total:
            raise ValueError(f"core share: home threads {home} must be within 1..{self.total}")
        self.max_wait_s = max_wait_s
        self._me, self._peer = ROLES.index(role), 1 - ROLES.index(role)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < SIZE:
            with self._locked():
                if os.fstat(self._fd).st_size < SIZE:
                    os.ftruncate(self._fd, SIZE)
        self._map = mmap.mmap(self._fd, SIZE)
        self.threads = 0  # what this party claims (0 while resting)
        self.busy = False
        self._since = time.monotonic()
        self._write(busy=False, threads=0)

    # --- the two calls ------------------------------------------------------------------

    def work(self) -> int:
        """Claim threads for work now; returns the count, already applied to torch."""
        started, waited = time.monotonic(), False
        while True:
            with self._locked():
                pid, peer_busy, held = self._read(self._peer)
                alive = _alive(pid)
                want = self.home if alive and peer_busy else self.total
                held = held if alive else 0
                ok = held + want <= self.total
                # Waiting, it computes nothing: it claims nothing, so a peer that waits for it
                # in turn is never blocked by it.
                self._write(busy=True, threads=want if ok else 0)
            if ok:
                break
            waited = True
            if time.monotonic() - started > self.max_wait_s:
                WAIT_OVERRUNS.labels(self.role).inc()
                log.warning("core share: the %s still holds a borrowed core after %.1f s; going ahead",
                            ROLES[self._peer], self.max_wait_s)  # fmt: skip
                want = self.home
                with self._locked():
                    self._write(busy=True, threads=want)
                break
            time.sleep(POLL_S)
        if waited:
            WAIT_SECONDS.labels(self.role).inc(time.monotonic() - started)
        self._account(busy=True, threads=want)
        return want

    def rest(self) -> None:
        """No work: claim nothing (the other party may use every core)."""
        if self.busy or self.threads:
            with self._locked():
                self._write(busy=False, threads=0)
            self._account(busy=False, threads=0)

    def close(self) -> None:
        self.rest()
        self._map.close()
        os.close(self._fd)

    # --- state --------------------------------------------------------------------------

    def _account(self, *, busy: bool, threads: int) -> None:
        now = time.monotonic()
        if self.busy:
            BUSY_SECONDS.labels(self.role, str(self.threads)).inc(now - self._since)
        self._since, self.busy = now, busy
        if threads and threads != _torch_threads():
            _set_torch_threads(threads)
            SWITCHES.labels(self.role).inc()
        if threads != self.threads:
            THREADS.labels(self.role).set(threads)
        self.threads = threads

    def _read(self, slot: int) -> tuple[int, int, int]:
        return SLOT.unpack_from(self._map, slot * SLOT.size)

    def _write(self, *, busy: bool, threads: int) -> None:
        SLOT.pack_into(self._map, self._me * SLOT.size, os.getpid(), int(busy), threads)

    def peer(self) -> tuple[int, bool, int]:
        """(pid, busy, claimed threads) of the other party, as the file says now."""
        with self._locked():
            pid, busy, threads = self._read(self._peer)
        return pid, bool(busy), threads

    class _Lock:
        def __init__(self, fd: int) -> None:
            self.fd = fd

        def __enter__(self) -> None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)

        def __exit__(self, *exc) -> None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _locked(self) -> CoreShare._Lock:
        return CoreShare._Lock(self._fd)


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
