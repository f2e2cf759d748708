"""The training worker: one thread that runs every model's commands on the backend, each model's
in seq-id order (docs/architecture.md §13).

The loop is the whole policy: for each live model, run its next command if its turn has come
(`CommandLog.head`), give up a missing seq id that held the queue past `gap_timeout_s`, and
release a finished session's models once their queues are empty. A session is finished when
its client closed it, or when it sent no heartbeat for `session_timeout_s` (a client that died:
its models would otherwise hold memory and `max_models` slots for good); silence is counted
from this process's start at the earliest, so a restart does not end every session. Both are
read from Redis at each pass, so a restart releases what it must. Each command's effect on the
model's durable record (`mutated`, the checkpoint a restart may restore) is written in the same
transaction as its result, so `recovery.py` can tell after a crash what the in-memory state held.

Failures: a backend refusal (`TinkerError`, `ValueError`) fails the call with the backend's
message (category `user`); anything else fails it as `server` and is counted and logged. The
worker never stops on a failed command. A call's outcome that Redis failed to record (its
effect is in memory already) is held and recorded at the next pass, before anything else runs:
never run again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncrl.services.runtime.logging import log_event
from asyncrl.services.tinker import metrics as m
from asyncrl.services.tinker.commands import Command, CommandLog
from asyncrl.services.tinker.paths import backend_id, sampler_path, sampling_session_id, training_path

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # between scans when nothing is ready (a submit wakes the worker at once)
MAX_ERROR_CHARS = 2000  # of a failure's message kept in the future (bounded error bodies)
STATE_CHANGING = frozenset({"create_model", "forward_backward", "optim_step", "load_weights"})


def arrays_to_json(arrays: dict[str, np.ndarray]) -> dict:
    return {
        name: {
            "dtype": "float32" if a.dtype.kind == "f" else "int64",
            "shape": list(a.shape),
            "data": a.ravel().tolist(),
        }
        for name, a in arrays.items()
    }


def arrays_from_json(data: dict) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(t["data"], dtype=np.float32 if t["dtype"] == "float32" else np.int64).reshape(
            t["shape"]
        )
        for name, t in data.items()
    }


class TrainingWorker:
    def __init__(
        self,
        commands: CommandLog,
        backend: Any,
        *,
        gap_timeout_s: float,
        notify: Callable[[str], None],
        tinker_module: Any,
        session_timeout_s: float = 600.0,
    ):
        self.log, self.backend, self.gap_timeout_s, self.notify = commands, backend, gap_timeout_s, notify
        self.session_timeout_s = session_timeout_s
        self.started = time.time()
        self.tinker = tinker_module  # asyncrl.trainer.tinker: its Datum and error classes
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unrecorded: dict[str, tuple[Command, dict]] = {}  # ran, result not yet in Redis

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tinker-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                busy = self.step()
            except Exception as exc:  # noqa: BLE001  (Redis down, a bug: the worker must outlive it)
                m.WORKER_ERRORS.inc()
                log_event(
                    log, "tinker worker step failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}"
                )
                busy = False
                time.sleep(IDLE_WAIT_S)
            if not busy:
                self._wake.wait(IDLE_WAIT_S)

    def step(self) -> bool:
        """One pass over the live models: run at most one command of each. True if any ran."""
        for rid in list(self._unrecorded):  # raises while Redis is still down: nothing else runs
            self._record(rid)
        ran = False
        for mid in self.log.live_models():
            command, missing = self.log.head(mid)
            if command is not None:
                self.run(command)
                ran = True
            elif missing is not None:
                self._check_gap(mid, missing)
            elif self._session_over(mid):
                self._unload(mid)
        return ran

    def _session_over(self, mid: str) -> bool:
        sid = (self.log.model(mid) or {}).get("session", "")
        session = self.log.session(sid)
        if session is None or "finished" in session:
            return True
        seen = max(float(session.get("seen", 0.0)), self.started)
        if time.time() - seen <= self.session_timeout_s:
            return False
        if self.log.expire_session(sid):
            m.SESSIONS_EXPIRED.inc()
            log_event(log, "session expired", session=sid, silent_s=round(time.time() - seen, 1))
        return True

    def _check_gap(self, mid: str, missing: int) -> None:
        waiting = self.log.queued(mid)
        oldest = min((c.queued_at for c in waiting), default=time.time())
        if time.time() - oldest < self.gap_timeout_s:
            return
        reason = (
            f"seq id {missing} of model {mid} never arrived within {self.gap_timeout_s:g} s, so the calls "
            "after it cannot run in order; they were not applied"
        )
        for command in self.log.give_up_gap(mid, missing, reason):
            m.COMMANDS.labels(command.kind, "gap").inc()
            self.notify(command.request_id)

    def _unload(self, mid: str) -> None:
        try:
            self.backend.unload(backend_id(mid))
        except self.tinker.UnknownModelError:
            pass
        self.log.update_model(mid, status="unloaded")
        for command in self.log.queued(mid):  # landed after the look that found the queue empty
            self.log.finish(command, error=f"not run: model {mid} was released (its session ended)")
            m.COMMANDS.labels(command.kind, "released").inc()
            self.notify(command.request_id)
        log_event(log, "model released", model=mid)

    # --- one command --------------------------------------------------------------------------

    def run(self, command: Command) -> None:
        self.log.start(command)
        started = time.monotonic()
        outcome, label = self._apply(command)
        m.COMMANDS.labels(command.kind, label).inc()
        m.COMMAND_SECONDS.labels(command.kind).observe(time.monotonic() - started)
        self._unrecorded[command.request_id] = (command, outcome)
        self._record(command.request_id)

    def _record(self, rid: str) -> None:
        command, outcome = self._unrecorded[rid]
        self.log.finish(command, **outcome)
        del self._unrecorded[rid]
        self.notify(rid)

    def _apply(self, command: Command) -> tuple[dict, str]:
        """Run `command` on the backend: (its outcome as `CommandLog.finish` takes it, its label)."""
        try:
            body = self.log.body(command.request_id)
            result, changes = getattr(self, f"_{command.kind}")(command, body)
        except (self.tinker.TinkerError, ValueError, KeyError) as exc:
            message = str(exc)[:MAX_ERROR_CHARS] or type(exc).__name__
            return {
                "error": message,
                "category": "user",
                "model_changes": _not_created(command, message),
            }, "refused"
        except Exception as exc:  # noqa: BLE001  (the call fails as `server`, counted; the worker goes on)
            message = f"internal error in {command.kind}: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            log_event(
                log,
                "tinker command failed",
                logging.ERROR,
                model=command.model_id,
                seq=command.seq,
                error=message,
            )
            return {
                "error": message,
                "category": "server",
                "model_changes": _not_created(command, message),
            }, "error"
        if command.kind in STATE_CHANGING:
            changes["mutated"] = command.seq
        return {"result": result, "model_changes": changes}, "done"

    def _create_model(self, command: Command, body: dict) -> tuple[dict, dict]:
        info = self.backend.create_model(
            backend_id(command.model_id), body["base_model"], body["lora"], seed=body["seed"]
        )
        return {"model_id": command.model_id, "type": "create_model"}, {"info": info}

    def _datums(self, body: dict) -> list:
        return [
            self.tinker.Datum(tokens=d["tokens"], inputs=arrays_from_json(d["inputs"])) for d in body["data"]
        ]

    def _forward(self, command: Command, body: dict) -> tuple[dict, dict]:
        out = self.backend.forward(
            backend_id(command.model_id), self._datums(body), body["loss_fn"], body["loss_fn_config"]
        )
        return _forward_result(out), {}

    def _forward_backward(self, command: Command, body: dict) -> tuple[dict, dict]:
        out = self.backend.forward_backward(
            backend_id(command.model_id), self._datums(body), body["loss_fn"], body["loss_fn_config"]
        )
        return _forward_result(out), {"grads": True}

    def _optim_step(self, command: Command, body: dict) -> tuple[dict, dict]:
        metrics = self.backend.optim_step(backend_id(command.model_id), body["adam"])
        return {"metrics": {k: float(v) for k, v in metrics.items()}}, {"grads": False}

    def _save_weights(self, command: Command, body: dict) -> tuple[dict, dict]:
        record = self.log.model(command.model_id) or {}
        name = body["name"] or f"seq{command.seq}"
        path = training_path(command.model_id, name)
        extra = {"model_id": command.model_id, "seq": command.seq, "tinker_path": path}
        backend_path = self.backend.save_state(backend_id(command.model_id), name, True, extra)
        checkpoint = {
            "kind": "training",
            "backend": backend_path,
            "model_id": command.model_id,
            "seq": command.seq,
            "base_model": record["base_model"],
            "lora": record["lora"],
            "clean": not record.get("grads", False),  # accumulated gradients are not in a checkpoint
        }
        self.log.put_record("ckpt", path, checkpoint)
        return {"path": path, "type": "save_weights"}, {"checkpoint": {"path": path, **checkpoint}}

    def _save_weights_for_sampler(self, command: Command, body: dict) -> tuple[dict, dict]:
        record = self.log.model(command.model_id) or {}
        name = body["name"] or f"seq{command.seq}"
        saved = self.backend.save_for_sampler(
            backend_id(command.model_id), name, keep=body["name"] is not None
        )
        path = sampler_path(command.model_id, name)
        sampler = {
            "kind": "sampler",
            "model_id": command.model_id,
            "base_model": record["base_model"],
            "adapter_name": saved["adapter_name"],
            "adapter_path": saved["adapter_path"],
            "version": saved.get("version"),
        }
        unnamed = (
            body["name"] is None
        )  # one a step (the cookbook's): its adapter is pruned, its records expire
        self.log.put_record("ckpt", path, sampler, expires=unnamed)
        result: dict = {"path": path, "type": "save_weights_for_sampler"}
        if body.get("sampling_session_seq_id") is not None:
            sid = sampling_session_id(record["session"], body["sampling_session_seq_id"])
            self.log.put_record("sampler", sid, {**sampler, "model_path": path}, expires=unnamed)
            result["sampling_session_id"] = sid
        return result, {}

    def _load_weights(self, command: Command, body: dict) -> tuple[dict, dict]:
        checkpoint = self.log.record("ckpt", body["path"])
        if checkpoint is None or checkpoint.get("kind") != "training":
            raise ValueError(f"no training checkpoint named {body['path']!r} (save_state writes them)")
        if command.seq == 0:  # create-via-load: the model is this checkpoint's
            record = self.log.model(command.model_id) or {}
            self.backend.create_model(
                backend_id(command.model_id),
                checkpoint["base_model"],
                checkpoint["lora"],
                seed=record["seed"],
            )
        extra = self.backend.load_state(
            backend_id(command.model_id), checkpoint["backend"], body["optimizer"]
        )
        if extra.get("tinker_path") not in (None, body["path"]):
            raise ValueError(f"checkpoint {body['path']!r} holds {extra.get('tinker_path')!r}")
        changes = {"grads": False, "info": self.backend.info(backend_id(command.model_id))}
        return {"path": body["path"], "model_id": command.model_id, "type": "load_weights"}, changes


def _not_created(command: Command, message: str) -> dict | None:
    """A model whose creating call (seq 0) failed does not exist: it holds no `max_models` slot,
    a restart does not try to build it again, and its later calls are refused naming why."""
    return {"status": "failed", "failed_reason": message} if command.seq == 0 else None


def _forward_result(out: Any) -> dict:
    metrics = {k: float(v) for k, v in out.metrics.items()}
    bad = [k for k in metrics if k.count(":") != 1]
    if bad:  # the SDK splits every metric name on ":" into (name, reduction)
        raise RuntimeError(f"backend metric names without one ':' reduction suffix: {bad}")
    return {
        "proto": "forward_backward",
        "outputs": [arrays_to_json(o) for o in out.outputs],
        "metrics": metrics,
    }
