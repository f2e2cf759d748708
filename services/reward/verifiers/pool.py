"""A pool of worker processes that score one JSON request at a time under a deadline.

Used by the verifiers whose scorer cannot be interrupted from inside (math-verify's timeout
needs `signal.alarm`; reasoning-gym's `score_answer` has none): a worker that runs past the
deadline is SIGKILLed and replaced in the background, and the caller gets `WorkerTimeout`.
A worker script speaks JSON lines: it prints `{"ready": true}` once its imports are done,
then one reply line per request line; `python -I SCRIPT MEMORY_MB` starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path

from prometheus_client import Counter

from asyncrl.services.reward.verifiers.base import Verifier
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 60.0  # importing sympy (or reasoning-gym) on a loaded 2-core box takes seconds


class WorkerTimeout(Exception):
    pass


class WorkerCrashed(Exception):
    pass


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def request(self, payload: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(payload) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise WorkerCrashed(f"worker exited with {await self.proc.wait()}")
        return json.loads(line)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


class WorkerPool:
    """`size` processes of `script`; `request()` runs one payload on an idle worker under a deadline.

    `restarts` counts each worker killed and replaced, by reason (timeout, crashed, cancelled,
    respawn_failed).
    """

    def __init__(
        self,
        script: Path,
        size: int,
        timeout_s: float,
        memory_mb: int,
        restarts: Counter,
        stream_limit: int = 1 << 16,
    ):
        self.script = script
        self.size = size
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.restarts = restarts
        self.stream_limit = stream_limit  # longest reply line read back (asyncio's default is 64 KiB)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self._idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(self.script),
            str(self.memory_mb),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=self.stream_limit,
        )
        worker = _Worker(proc)
        self._all.add(worker)
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), WORKER_START_TIMEOUT_S)
        except BaseException:
            await self._discard(worker)
            raise
        if json.loads(ready or b"{}").get("ready") is not True:
            await self._discard(worker)
            raise WorkerCrashed(f"{self.script.name} failed to start (exit {proc.returncode})")
        return worker

    async def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()

    def _replace(self, worker: _Worker, reason: str) -> None:
        """Kill `worker` and start its replacement in the background."""
        self.restarts.labels(reason).inc()
        log_event(
            log,
            "worker replaced",
            logging.WARNING,
            script=self.script.name,
            reason=reason,
            pid=worker.proc.pid,
        )

        async def replace() -> None:
            await self._discard(worker)
            while not self._closed:
                try:
                    self._idle.put_nowait(await self._spawn())
                    return
                except Exception:
                    self.restarts.labels("respawn_failed").inc()
                    log.exception("%s respawn failed; retrying in 1 s", self.script.name)
                    await asyncio.sleep(1.0)

        task = asyncio.get_running_loop().create_task(replace())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def request(self, payload: dict) -> dict:
        worker = await self._idle.get()
        failure = "crashed"  # unless it answered, timed out or was cancelled
        try:
            reply = await asyncio.wait_for(worker.request(payload), self.timeout_s)
            failure = ""
            return reply
        except TimeoutError:
            failure = "timeout"
            raise WorkerTimeout(f"{self.script.stem} ran past {self.timeout_s:g}s") from None
        except asyncio.CancelledError:
            failure = "cancelled"
            raise
        except ValueError as exc:  # a reply over `stream_limit` or not JSON: the pipe is out of step
            raise WorkerCrashed(f"{self.script.stem} reply unreadable: {str(exc)[:200]}") from None
        finally:
            if not failure:
                self._idle.put_nowait(worker)
            else:  # its pipe state is unknown: replaced
                self._replace(worker, failure)

    def alive(self) -> int:
        return sum(1 for worker in self._all if worker.proc.returncode is None)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*(self._discard(w) for w in list(self._all)), return_exceptions=True)


SLOT_WAIT_GRACE_S = 2.0  # item budget beyond a worker's timeout: waiting for a replaced worker


class PooledVerifier(Verifier):
    """A verifier that scores in a `WorkerPool` of its own (math-verify, reasoning-gym): one
    item in flight per worker, the item's budget the worker's timeout plus the wait for a
    replaced worker, healthy while one worker lives."""

    def __init__(self, worker: Path, *, workers: int, timeout_s: float, memory_mb: int, restarts: Counter):
        super().__init__(concurrency=workers, timeout_s=timeout_s + SLOT_WAIT_GRACE_S)
        self.pool = WorkerPool(worker, workers, timeout_s, memory_mb, restarts)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def health(self) -> str:
        return "ok" if self.pool.alive() > 0 else "degraded"
