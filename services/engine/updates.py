"""Weight updates one at a time, each time-bounded, and the health they report.

* One at a time: every update (`/update_weights_from_disk`, `/update_weights_from_distributed`,
  `/init_weights_update_group`) takes its turn on one lock and must get it within its own
  deadline, or it is answered "busy" (503). A second `/init_weights_update_group` while one is
  joining is refused at once, so a burst of joins naming a dead address cannot queue ahead of
  the next disk update for minutes.
* Time-bounded: the blocking part of an update (resolving and reading a checkpoint, the
  rendezvous, receiving a broadcast) runs on a thread of its own (`in_thread`; an idle one is
  reused), never on the event loop's executor (which tokenizes `/generate` texts) nor on the
  scheduler thread (which decodes). The caller stops waiting at the deadline and answers with
  a timeout; the thread is abandoned, not joined: it is a daemon, so it holds neither the next
  update nor shutdown (SIGTERM). What it returns after its deadline is dropped. Limit: an
  abandoned thread may still be running while the next update runs (a read of a hung file
  system, a rendezvous that ignores its own timeout); it holds only what it allocated.
  Limit (NCCL groups, GPU only; untested here): an NCCL broadcast whose sender died does not
  raise on this thread. Its kernel hangs on the device and stalls the engine's stream, and
  NCCL's watchdog ends the process after the group's timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING
  default). So an NCCL weight sync that dies half-way restarts the engine: the launcher's
  supervision or the orchestrator brings it back. A gloo group raises, and the group is dropped.
* Health (`degraded()`, `/health` answers 503 with the reason): the engine is degraded while
  the last update that was attempted failed (an error or a timeout while reading, joining,
  receiving or applying), until a later one succeeds (a later weight load; a failed join is
  also cleared by a later join), and while an update runs past its deadline (one that cannot be cancelled, e.g. a weight copy under way on the scheduler
  thread). Requests refused before any work (bad token, bad body, a path outside
  `weights_root`, an unknown group, busy) change nothing: they leave the weights as they were.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from asyncrl.services.engine import metrics


class UpdateTimeout(Exception):
    """The blocking part of an update did not finish by its deadline."""


class UpdateBusy(Exception):
    """Another update held the turn for the whole deadline of this one."""


@dataclass(frozen=True)
class Failure:
    source: str  # disk | distributed | group
    message: str
    at: float  # time.time()


class WeightUpdates:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.joining = False  # an init_weights_update_group holds or waits for the turn
        self.pending = 0  # updates holding or waiting for the turn
        self.last_failure: Failure | None = None
        self.last_success_at: float | None = None
        self._running: tuple[str, float] | None = None  # (source, monotonic deadline) of the holder

    @asynccontextmanager
    async def turn(self, source: str, timeout_s: float) -> AsyncIterator[float]:
        """Hold the update turn; yields the monotonic deadline of this update (`timeout_s` from
        now, the wait for the turn included). Raises `UpdateBusy` when the turn does not come."""
        deadline = time.monotonic() + timeout_s
        self._pending(+1)
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._lock.acquire()
            except TimeoutError:
                self.record(source, "busy")
                raise UpdateBusy(f"another weight update held the engine for {timeout_s:g} s") from None
            try:
                self._running = (source, deadline)
                yield deadline
            finally:
                self._running = None
                self._lock.release()
        finally:
            self._pending(-1)

    def _pending(self, delta: int) -> None:
        self.pending += delta
        metrics.WEIGHT_UPDATES_PENDING.set(self.pending)

    def record(self, source: str, result: str, message: str = "") -> None:
        """Count an outcome: `error` and `timeout` set a failure; `ok` clears it (a joined group
        clears only a failed join: the weights are as stale as before); `refused` and `busy`
        leave the health as it was."""
        metrics.WEIGHT_UPDATES.labels(source=source, result=result).inc()
        if result == "ok" and source == "group":
            if self.last_failure is not None and self.last_failure.source == "group":
                self.last_failure = None
        elif result == "ok":
            self.last_failure, self.last_success_at = None, time.time()
            metrics.WEIGHT_UPDATE_LAST_SUCCESS.set(self.last_success_at)
        elif result in ("error", "timeout"):
            self.last_failure = Failure(source, message, time.time())
        metrics.WEIGHT_SYNC_DEGRADED.set(0 if self.last_failure is None else 1)

    def degraded(self) -> dict | None:
        """None when healthy, else the reason `/health` reports with its 503."""
        running = self._running
        if running is not None and time.monotonic() > running[1]:
            return {
                "reason": "weight_update_stuck",
                "message": f"a {running[0]} weight update is running past its deadline",
            }
        failure = self.last_failure
        if failure is not None:
            return {
                "reason": "weight_update_failed",
                "message": f"the last weight update ({failure.source}) failed and none has succeeded "
                f"since: {failure.message}",
                "failed_at": failure.at,
                "last_success_at": self.last_success_at,
            }
        return None

    def state(self) -> dict:
        return {
            "pending": self.pending,
            "last_success_at": self.last_success_at,
            "degraded": self.degraded(),
        }


class _Workers:
    """Daemon threads that each run one call at a time and then wait for the next. Starting a
    thread per update cost ~0.3 ms of every weight update's latency. A call past its deadline
    keeps its thread (abandoned, as above); the next call takes an idle one or starts another."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None], name: str) -> None:
        """`fn()` (which must not raise) on an idle thread, now named `name`."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put((fn, name))

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            fn, name = inbox.get()
            threading.current_thread().name = name
            fn()
            with self._lock:
                self._idle.append(inbox)


_WORKERS = _Workers()


async def in_thread(fn: Callable[[], Any], deadline: float, name: str) -> Any:
    """`fn()` on a daemon thread of its own (`_Workers`); its result, or `UpdateTimeout` at the
    monotonic `deadline` (the thread is then abandoned: see the module docstring)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # the caller stopped waiting: the late result is dropped
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        result, exc = None, None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 — handed to the waiting caller, who owns the policy
            exc = e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed (shutdown): nobody waits any more
            pass

    _WORKERS.run(run, name)
    try:
        return await asyncio.wait_for(done, max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        raise UpdateTimeout(f"{name} did not finish in time") from None
