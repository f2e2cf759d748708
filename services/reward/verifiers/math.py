"""`math` verifier: final-answer equivalence with math-verify, in a pool of worker processes.

math-verify's own timeout relies on `signal.alarm` (main thread only) and raises a
`BaseException`, so it is switched off; instead each request has a deadline here and a
worker that runs past it is SIGKILLed and replaced. Inputs are capped before parsing: the
last `\\boxed{…}` is cut out of the completion (else its last `max_chars` characters are
parsed). A gold answer that does not parse is `invalid_input`, never a 0 reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import MathSpec
from asyncrl.services.reward.metrics import MATH_WORKER_RESTARTS
from asyncrl.services.reward.verifiers.base import Verdict, Verifier
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("math_worker.py")
WORKER_START_TIMEOUT_S = 60.0  # importing sympy on a loaded 2-core box can take seconds
SLOT_WAIT_GRACE_S = 2.0  # item budget beyond the math timeout: waiting for a replaced worker
BOXED = "\\boxed"


def last_boxed(text: str, max_chars: int) -> str | None:
    """The last `\\boxed{…}` of `text` (braces balanced, at most `max_chars`), else None."""
    start = text.rfind(BOXED + "{")
    if start < 0:
        return None
    depth = 0
    end_limit = min(len(text), start + max_chars)
    for i in range(start + len(BOXED), end_limit):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def answer_region(completion: str, max_chars: int) -> tuple[str, bool]:
    """The text handed to the parser and whether the completion was cut to produce it."""
    boxed = last_boxed(completion, max_chars)
    if boxed is not None:
        return boxed, False
    return completion[-max_chars:], len(completion) > max_chars


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


class MathPool:
    """`size` worker processes; `check()` runs one request on an idle worker under a deadline."""

    def __init__(self, size: int, timeout_s: float, memory_mb: int):
        self.size = size
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
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
            str(WORKER),
            str(self.memory_mb),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
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
            raise WorkerCrashed(f"math worker failed to start (exit {proc.returncode})")
        return worker

    async def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()

    def _replace(self, worker: _Worker, reason: str) -> None:
        """Kill `worker` and start its replacement in the background."""
        MATH_WORKER_RESTARTS.labels(reason).inc()
        log_event(log, "math worker replaced", logging.WARNING, reason=reason, pid=worker.proc.pid)

        async def replace() -> None:
            await self._discard(worker)
            while not self._closed:
                try:
                    self._idle.put_nowait(await self._spawn())
                    return
                except Exception:
                    MATH_WORKER_RESTARTS.labels("respawn_failed").inc()
                    log.exception("math worker respawn failed; retrying in 1 s")
                    await asyncio.sleep(1.0)

        task = asyncio.get_running_loop().create_task(replace())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def check(self, gold: str, pred: str) -> dict:
        worker = await self._idle.get()
        done = False
        try:
            reply = await asyncio.wait_for(worker.request({"gold": gold, "pred": pred}), self.timeout_s)
            done = True
            return reply
        except TimeoutError:
            raise WorkerTimeout(f"math-verify ran past {self.timeout_s:g}s") from None
        finally:
            if done:
                self._idle.put_nowait(worker)
            else:  # timed out, crashed or cancelled mid-request: its pipe state is unknown
                reason = "timeout" if worker.proc.returncode is None else "crashed"
                self._replace(worker, reason)

    def alive(self) -> int:
        return sum(1 for worker in self._all if worker.proc.returncode is None)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*(self._discard(w) for w in list(self._all)), return_exceptions=True)


class MathVerifier(Verifier):
    name = "math"
    description = (
        "Final-answer equivalence with math-verify: the last \\boxed{} of the completion (else its "
        "tail) against `answer`. 1 if equivalent, 0 if not; a gold that does not parse is invalid_input."
    )
    Spec = MathSpec

    def __init__(self, *, workers: int, timeout_s: float, max_chars: int, memory_mb: int):
        super().__init__(concurrency=workers, timeout_s=timeout_s + SLOT_WAIT_GRACE_S)
        self.max_chars = max_chars
        self.pool = MathPool(workers, timeout_s, memory_mb)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def health(self) -> str:
        return "ok" if self.pool.alive() > 0 else "degraded"

    async def verify(self, spec: MathSpec, prompt: str, completion: str) -> Verdict:
        if len(spec.answer) > self.max_chars:
            return Verdict.failed(RewardStatus.invalid_input, "gold_too_long", max_chars=self.max_chars)
        pred, truncated = answer_region(completion, self.max_chars)
        try:
            reply = await self.pool.check(spec.answer, pred)
        except WorkerTimeout as exc:
            return Verdict.failed(RewardStatus.timeout, "math_timeout", error=str(exc))
        except WorkerCrashed as exc:
            return Verdict.failed(RewardStatus.error, "math_worker_crashed", error=str(exc))
        if "error" in reply:
            return Verdict.failed(RewardStatus.error, "math_verify_error", error=reply["error"])
        if not reply["gold_ok"]:
            return Verdict.failed(RewardStatus.invalid_input, "gold_unparseable", gold=spec.answer[:200])
        return Verdict.scored(
            1.0 if reply["equal"] else 0.0,
            gold=reply["gold_extracted"],
            extracted=reply["pred_extracted"],
            truncated=truncated,
        )
