"""What a restarted service does with the models it finds in Redis (docs/architecture.md §13,
"Restarts").

A model's weights, optimizer state and accumulated gradients live in the process that died;
Redis holds its record: the seq id of the last command that changed that state (`mutated`),
its restore points (its origin: created with a stored seed, or loaded from a checkpoint; and
the last `save_weights` taken with no gradients pending, whose checkpoint `extra` carries its
seq id) and its unfinished commands. For each live model:

* nothing created yet (its seq-0 command never finished): its commands wait, untouched;
* no state change after its latest restore point: the model is rebuilt at that point (same
  seed, or the checkpoint with its optimizer state) and its unfinished commands, the one that
  was running included, run in order as if nothing happened: none of them had an effect that
  survived, so each is applied exactly once;
* otherwise the state since that point is gone: the model is marked lost and its unfinished
  calls fail with a message naming the checkpoint to resume from. Nothing is replayed, so
  nothing is applied twice; finished calls keep their results;
* a restore point that cannot be built (its checkpoint deleted, or overwritten by a later save
  under its name) gives the model up the same way, naming why: one model never stops the
  service from starting.

A model whose creating call failed is not live (`worker._not_created`): nothing to rebuild; nor
is one whose session ended with nothing left to run: it is released.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.services.runtime.logging import log_event
from asyncrl.services.tinker import metrics as m
from asyncrl.services.tinker.commands import QUEUED, RUNNING, CommandLog
from asyncrl.services.tinker.paths import backend_id

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 2000  # of a rebuild's failure kept as the model's reason (bounded error bodies)


def restore_point(record: dict) -> dict:
    """The latest state a model can be rebuilt at: `{"seq", "checkpoint"}`: its creation (seq 0;
    checkpoint None when created from its seed, else the checkpoint it was loaded from, whose own
    "seq" is the one it was saved at by its model) or its last clean save."""
    point = {"seq": 0, "checkpoint": record.get("origin_checkpoint")}
    saved = record.get("checkpoint")
    if saved and saved.get("clean") and saved["seq"] >= point["seq"]:
        point = {"seq": saved["seq"], "checkpoint": saved}
    return point


def recover(commands: CommandLog, backend: Any) -> dict[str, str]:
    """Rebuild or give up each live model; the outcome per model id."""
    outcomes = {}
    for mid in commands.live_models():
        record = commands.model(mid) or {}
        pending = [c for c in commands.queued(mid) if c.state in (QUEUED, RUNNING)]
        for command in pending:
            if command.state == RUNNING:
                commands.redis.hset(commands.key("future", command.request_id), "state", QUEUED)
        session = commands.session(record.get("session", ""))
        if not pending and (session is None or "finished" in session):
            commands.update_model(mid, status="unloaded")  # its session ended: nothing to rebuild
            outcomes[mid] = "released"
        elif int(record.get("cursor", -1)) < 0:
            outcomes[mid] = "pending"
        else:
            point = restore_point(record)
            if int(record.get("mutated", -1)) <= point["seq"]:
                outcomes[mid] = _rebuild(commands, backend, mid, record, point, pending)
            else:
                _lose(commands, mid, _lost_reason(mid, record, point), pending)
                outcomes[mid] = "lost"
        m.RECOVERED.labels(outcomes[mid]).inc()
        log_event(log, "model found at start", model=mid, outcome=outcomes[mid], unfinished=len(pending))
    return outcomes


def _rebuild(commands: CommandLog, backend: Any, mid: str, record: dict, point: dict, pending: list) -> str:
    """ "restored", or "failed" when the restore point cannot be built (its checkpoint deleted or
    overwritten, a base model no longer served): the model is given up with the reason, and the
    service starts with the others."""
    try:
        _build(backend, mid, record, point["checkpoint"])
    except Exception as exc:  # noqa: BLE001  (one model's restore point must not stop the service)
        if backend_id(mid) in backend.models():
            backend.unload(backend_id(mid))
        reason = (
            f"the tinker service restarted and model {mid} could not be rebuilt at seq {point['seq']}: "
            f"{type(exc).__name__}: {exc}"
        )[:MAX_REASON_CHARS]
        _lose(commands, mid, reason, pending)
        return "failed"
    commands.update_model(mid, grads=False)
    return "restored"


def _build(backend: Any, mid: str, record: dict, checkpoint: dict | None) -> None:
    backend.create_model(backend_id(mid), record["base_model"], record["lora"], seed=record["seed"])
    if checkpoint is not None:
        # An origin loaded without its optimizer state (create_training_client_from_state) is
        # rebuilt the same way; a save_weights checkpoint always restores it.
        extra = backend.load_state(backend_id(mid), checkpoint["backend"], checkpoint.get("optimizer", True))
        if "seq" in extra and int(extra["seq"]) != int(checkpoint["seq"]):
            raise RuntimeError(
                f"checkpoint {checkpoint['backend']} of {mid} says seq {extra['seq']}, its record {checkpoint['seq']}"
            )


def _lost_reason(mid: str, record: dict, point: dict) -> str:
    checkpoint = point["checkpoint"]
    resume = (
        f"resume from {checkpoint['path']} (seq {point['seq']}) with "
        "ServiceClient.create_training_client_from_state_with_optimizer()"
        if checkpoint and checkpoint.get("path")
        else "no checkpoint was saved, so the model starts over"
    )
    return (
        f"the tinker service restarted and the in-memory state of model {mid} after seq {point['seq']} "
        f"(it had applied up to seq {record.get('cursor')}) is gone; {resume}"
    )


def _lose(commands: CommandLog, mid: str, reason: str, pending: list) -> None:
    commands.update_model(mid, status="lost", lost_reason=reason)
    for command in pending:
        commands.finish(command, error=f"not applied: {reason}", category="server")
        m.COMMANDS.labels(command.kind, "lost").inc()
