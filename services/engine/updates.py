"""How the reference engine takes new weights, one update at a time, each time-bounded, and the
health they report. `WeightControlMixin` is the part of `InferenceEngine` that answers the
weight routes: `/update_weights_from_disk`, `/init_weights_update_group`,
`/update_weights_from_distributed` and the weight-update session around the latter
(`begin_weight_update`/`end_weight_update`, as SGLang 0.5.23: buckets are taken only inside
one). Which deltas apply, and on what base: `services/engine/deltas.py`.

* Confined: a disk update loads only an absolute directory of `*.safetensors` inside
  `weights_root` once symlinks and '..' are resolved (`resolve_weights_dir`), and every refused
  path gets the same answer (`REFUSED_PATH`): it tells a caller nothing about what exists on the
  engine's file system. Without `weights_root` disk updates are refused.
* One at a time: every update (`/update_weights_from_disk`, `/update_weights_from_distributed`,
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
* Checked before copied: an update's tensors (a checkpoint, or one broadcast bucket) are
  checked against the model before any is copied; the copy runs on the scheduler thread once
  the running requests are drained (unless generation is paused). Past the deadline a copy not
  yet started is withdrawn; one under way is waited for, since withdrawing it would leave
  half-copied weights.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.proto.sglang import (
    InitWeightsUpdateGroupReqInput,
    ReferenceUpdateWeightsFromDistributedReqInput,
    UpdateWeightFromDiskReqInput,
)
from asyncrl.services.engine import deltas, metrics
from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.engine.deltas import BroadcastChain, Loaded
from asyncrl.services.engine.model_runner import ModelRunner, read_checkpoint
from asyncrl.services.engine.scheduler import Scheduler
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.transport.weights import broadcast as weight_broadcast
from asyncrl.services.transport.weights.delta import DeltaError, is_delta_dir, tensor_sha256
from asyncrl.services.transport.weights.filesystem import WEIGHTS_GLOB

log = logging.getLogger(__name__)

# One answer for every model_path refused (relative, outside weights_root once symlinks and '..'
# are resolved, missing, not a directory, no *.safetensors): the answer must not tell a caller
# what exists on the engine's file system.
REFUSED_PATH = "model_path refused: not a directory of *.safetensors files inside the engine's weights_root"
# The rendezvous gets the time left of its turn; the caller waits this much longer, so that the
# library's own timeout (a clean error) normally comes first and ours is the backstop.
JOIN_GRACE_S = 2.0
NOT_APPLIED_IN_TIME = "the engine did not reach a point to apply the weights in time"
# SGLang 0.5.23's answers (scheduler_components/weight_updater.py), word for word
OUTSIDE_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


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


@dataclass(frozen=True)
class UpdateResult:
    ok: bool
    message: str
    # HTTP status: 200, 400 (refused or failed), 409 (a join under way; a broadcast delta that
    # needs a full version), 503 (busy)
    status: int
    num_paused_requests: int = 0


def resolve_weights_dir(root: str, path: str) -> str | None:
    """The real path of checkpoint directory `path` when it lies inside `root` (both resolved:
    symlinks, '..') and holds *.safetensors files that resolve inside `root` too; else None."""
    if not os.path.isabs(path):
        return None
    try:
        real_root, real = os.path.realpath(root), os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root or not os.path.isdir(real):
            return None
        files = glob.glob(os.path.join(glob.escape(real), WEIGHTS_GLOB))
        inside = [os.path.commonpath([real_root, os.path.realpath(f)]) == real_root for f in files]
    except (OSError, ValueError):  # a NUL byte in the path, an unreadable directory
        return None
    return real if files and all(inside) else None


class WeightControlMixin:
    """The weight routes of `InferenceEngine`, which it is mixed into (module docstring). The
    state they use and change lives on the engine, which sets it up in its `__init__`."""

    settings: EngineSettings
    runner: ModelRunner
    scheduler: Scheduler
    updates: WeightUpdates
    groups: dict[str, object]  # group_name → process group
    # the published version directory the weights came from: the base a delta must name
    loaded: Loaded | None
    # the whole version broadcasts made the weights: the base a broadcast delta must name
    chain: BroadcastChain
    weight_session: bool  # SGLang 0.5.23's weight-update session is open
    weight_version: str

    async def update_weights_from_disk(self, req: UpdateWeightFromDiskReqInput) -> UpdateResult:
        root = self.settings.weights_root
        if root is None:
            self.updates.record("disk", "refused")
            return UpdateResult(
                False, "update_weights_from_disk is disabled: the engine has no weights_root", 400
            )

        loaded = self.loaded

        def read() -> tuple[dict[str, torch.Tensor], bool, Loaded | None] | None:
            """(tensors, whether they cover the whole model, the version they make)."""
            real = resolve_weights_dir(root, req.model_path)
            if real is None:
                return None
            if is_delta_dir(real):
                return deltas.rebuild(
                    real,
                    loaded,
                    self.runner.model.state_dict,
                    lambda p: resolve_weights_dir(root, p),
                )
            return read_checkpoint(real), True, deltas.loaded_of(real)

        try:
            async with self.updates.turn("disk", self.settings.weight_update_timeout_s) as deadline:
                try:
                    got = await in_thread(read, deadline, "weights-read")
                except UpdateTimeout:
                    return self._failed("disk", "timeout", "reading the checkpoint timed out")
                except DeltaError as exc:  # the delta and its resync both failed: weights kept
                    return self._failed("disk", "error", f"delta refused ({exc.reason}): {exc}")
                except (OSError, ValueError) as exc:  # a corrupt or unreadable file inside the root
                    return self._failed("disk", "error", f"cannot read the checkpoint: {exc}")
                if got is None:
                    self.updates.record("disk", "refused")
                    return UpdateResult(False, REFUSED_PATH, 400)
                named, whole, made = got
                error = self.runner.check_weights(named, full=whole)
                if error:
                    return self._failed("disk", "error", error)
                if req.abort_all_requests:
                    self.scheduler.abort(abort_all=True, message="aborted for a weight update")
                self.loaded = None  # until the copy is done: a timed-out one may be half applied
                self.chain.clear()
                retracted = await self._set_weights(named, req.weight_version, deadline)
                self.loaded = made
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        except UpdateTimeout:
            return self._failed("disk", "timeout", NOT_APPLIED_IN_TIME)
        self.updates.record("disk", "ok")
        log_event(log, "weights updated from disk", path=req.model_path, version=self.weight_version)
        return UpdateResult(True, f"Succeeded to update model weights from {req.model_path}.", 200, retracted)

    async def init_weights_update_group(self, req: InitWeightsUpdateGroupReqInput) -> UpdateResult:
        if req.group_name in self.groups:
            self.updates.record("group", "refused")
            return UpdateResult(False, f"group {req.group_name!r} already exists", 400)
        if req.backend == "nccl" and self.runner.device.type != "cuda":
            self.updates.record("group", "refused")
            return UpdateResult(
                False, "backend nccl needs a CUDA device; this engine runs on CPU (use gloo)", 400
            )
        if self.updates.joining:
            self.updates.record("group", "busy")
            return UpdateResult(False, "another init_weights_update_group is under way; retry after it", 409)
        self.updates.joining = True
        try:
            async with self.updates.turn("group", self.settings.weight_group_timeout_s) as deadline:

                def join():
                    return weight_broadcast.init_weight_update_group(
                        req.master_address,
                        req.master_port,
                        req.rank_offset,
                        req.world_size,
                        req.group_name,
                        req.backend,
                        timeout_s=max(deadline - time.monotonic(), 0.1),
                    )

                try:
                    group = await in_thread(join, deadline + JOIN_GRACE_S, "weights-join")
                except UpdateTimeout:
                    return self._failed(
                        "group",
                        "timeout",
                        f"joining {req.group_name!r} timed out "
                        f"after {self.settings.weight_group_timeout_s:g} s",
                    )
                # a rendezvous timeout, a refused connection, a bad backend
                except (RuntimeError, ValueError) as exc:
                    return self._failed("group", "error", f"failed to join {req.group_name!r}: {exc}")
                self.groups[req.group_name] = group
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        finally:
            self.updates.joining = False
        self.updates.record("group", "ok")
        log_event(
            log,
            "joined weight update group",
            group=req.group_name,
            rank=req.rank_offset,
            world=req.world_size,
        )
        return UpdateResult(
            True, f"Joined weight update group {req.group_name!r} as rank {req.rank_offset}.", 200
        )

    async def update_weights_from_distributed(
        self, req: ReferenceUpdateWeightsFromDistributedReqInput
    ) -> UpdateResult:
        try:
            dtypes = [weight_broadcast.parse_dtype(d) for d in req.dtypes]
        except ValueError as exc:
            self.updates.record("distributed", "refused")
            return UpdateResult(False, str(exc), 400)
        try:
            async with self.updates.turn("distributed", self.settings.weight_update_timeout_s) as deadline:
                group = self.groups.get(req.group_name)
                if group is None:
                    self.updates.record("distributed", "refused")
                    return UpdateResult(
                        False,
                        f"no weight update group {req.group_name!r}; call /init_weights_update_group first",
                        400,
                    )
                if req.abort_all_requests:
                    self.scheduler.abort(abort_all=True, message="aborted for a weight update")
                device = "cpu" if isinstance(group, dist.ProcessGroupGloo) else self.runner.device

                def receive() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
                    got = weight_broadcast.receive_bucket(group, req.names, dtypes, req.shapes, device)
                    # a delta's hashes here, off the event loop
                    return got, {n: tensor_sha256(t) for n, t in got.items()} if req.delta else {}

                try:
                    received, digests = await in_thread(receive, deadline, "weights-receive")
                except (UpdateTimeout, RuntimeError) as exc:
                    # The sender and this engine no longer agree on where the stream is: the group
                    # is dropped, and the trainer joins a new one (a fresh name per start).
                    self.groups.pop(req.group_name, None)
                    self.chain.clear()
                    result = "timeout" if isinstance(exc, UpdateTimeout) else "error"
                    return self._failed(
                        "distributed",
                        result,
                        f"receiving from {req.group_name!r} failed ({exc}); group dropped",
                    )
                # Every tensor was received before these checks, so the sender is never left blocked.
                if not self.weight_session:
                    self.updates.record("distributed", "refused")
                    return UpdateResult(False, OUTSIDE_SESSION, 400)
                error = self.runner.check_weights(received, full=False)
                if error:
                    return self._failed("distributed", "error", error)
                if req.delta is not None:
                    refused = self._refuse_delta(req, digests)
                    if refused is not None:
                        return refused
                self.loaded = None  # no longer the weights of a published directory
                base = None if req.delta is None else req.delta.base
                self.chain.applying(req.group_name, base, req.names)
                await self._set_weights(received, req.weight_version, deadline)
                outcome = self.chain.applied(req.group_name, req.weight_version)
                if outcome is not None:
                    metrics.WEIGHT_DELTAS.labels(result=outcome).inc()
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        except UpdateTimeout:
            self.chain.clear()  # the copy may have been under way
            return self._failed("distributed", "timeout", NOT_APPLIED_IN_TIME)
        self.updates.record("distributed", "ok")
        log_event(log, "weights updated from broadcast", count=len(req.names), version=self.weight_version)
        return UpdateResult(True, f"Succeeded to update {len(received)} parameters.", 200)

    def begin_weight_update(self) -> UpdateResult:
        """Open the weight-update session (SGLang restores packed weights here; this engine keeps
        none, so only the session's state is kept). One at a time, as in SGLang."""
        if self.weight_session:
            self.updates.record("session", "refused")
            return UpdateResult(
                False, "a weight-update session is already open; call end_weight_update() first", 400
            )
        self.weight_session = True
        return UpdateResult(True, "Success", 200)

    def end_weight_update(self) -> UpdateResult:
        if not self.weight_session:
            self.updates.record("session", "refused")
            return UpdateResult(False, NO_SESSION, 400)
        self.weight_session = False
        return UpdateResult(True, "Success", 200)

    def _refuse_delta(
        self, req: ReferenceUpdateWeightsFromDistributedReqInput, digests: dict[str, str]
    ) -> UpdateResult | None:
        """The answer to a delta bucket that must not be applied (every tensor of it received
        already, each hashed to `digests`), counted; None to apply it. A 409 asks the sender
        for a full version."""
        assert req.delta is not None
        if set(req.delta.sha256) != set(req.names):
            self.updates.record("distributed", "refused")
            return UpdateResult(False, "a delta bucket needs one sha256 per name, and only those", 400)
        refused = self.chain.refusal(req.group_name, req.delta.base, req.delta.sha256, digests)
        if refused is None:
            return None
        reason, message = refused
        metrics.WEIGHT_RESYNCS.labels(reason=reason).inc()
        if reason == "hash":  # bytes that changed on the way: a failure, even if a resync follows
            self.updates.record("distributed", "error", message)
        else:  # nothing was applied: the weights are what they were
            self.updates.record("distributed", "refused")
        log_event(log, "broadcast delta refused", logging.WARNING, reason=reason, message=message)
        return UpdateResult(False, f"{message} (serving weight_version {self.weight_version!r})", 409)

    async def _set_weights(self, named: dict[str, torch.Tensor], weight_version: str | None, deadline: float):
        """Install `named` as `weight_version` (`_apply`: between scheduler steps, by `deadline`)."""
        return await self._apply(
            lambda: self.scheduler.set_weights(lambda: self.runner.apply_weights(named), weight_version),
            deadline,
        )

    async def _apply(self, fn, deadline: float):
        """`fn()` on the scheduler thread once running requests are drained (unless paused), by
        `deadline`. Past it, a call not yet started is withdrawn (`UpdateTimeout`); one already
        started (a weight copy) is awaited: withdrawing it would leave half-copied weights."""
        call = self.scheduler.call(fn, drain=True)
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(call)), max(deadline - time.monotonic(), 0.0)
            )
        except TimeoutError:
            if call.cancel():
                raise UpdateTimeout("the scheduler did not take the update in time") from None
            return await asyncio.wrap_future(call)

    def _failed(self, source: str, result: str, message: str) -> UpdateResult:
        self.updates.record(source, result, message)
        log_event(log, "weight update failed", logging.WARNING, source=source, result=result, message=message)
        return UpdateResult(False, message, 400)
