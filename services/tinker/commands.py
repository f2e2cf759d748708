"""The command log: every training call of every model, its future and its result, in Redis
(docs/architecture.md §13, "Ordering, retries and restarts").

What it guarantees:
* One record per (model, seq id). A call whose (model, seq id) is already recorded is the
  same call retried: it gets the same `request_id` back and nothing new is queued. A different
  body under a used seq id is refused (`SeqConflict`), and so is a seq id at or behind the
  model's cursor that has no record (`SeqBehind`: it was given up, or its record expired).
* A model's commands run in seq-id order: one runs once every lower seq id has finished
  (`head`). A missing seq id holds the ones behind it for `gap_timeout_s` after the first of
  them arrived; then it is given up and they fail, naming it (`give_up_gap`).
* A future is `queued`, `running`, `done` (its result kept) or `failed` (its message kept);
  finished ones and their seq ids live `result_ttl_s`, the rest until they finish.
* JSON only: bodies, results and model records are JSON text, never pickle.

Limits: one service process per namespace writes it (a lock serialises its writers, so no
Lua is needed); a second process on the same namespace is not detected.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from dataclasses import dataclass

import redis

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
GAP = "gap"  # what the seq-id key of a given-up seq id holds instead of a request id


class SeqConflict(ValueError):
    """A seq id already used by a different call."""


class SeqBehind(ValueError):
    """A seq id at or behind the model's cursor with no record."""


class QueueFull(RuntimeError):
    """The model has `max_queued` commands waiting."""


class ModelGone(RuntimeError):
    """The model is no longer live (released, lost, never created): nothing would run the call."""


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


@dataclass
class Command:
    request_id: str
    model_id: str
    seq: int
    kind: str
    state: str
    queued_at: float


class CommandLog:
    def __init__(self, client: redis.Redis, namespace: str, *, max_queued: int, result_ttl_s: int):
        self.redis, self.max_queued, self.ttl = client, max_queued, result_ttl_s
        self.prefix = f"tinker:{namespace}:"
        self._lock = threading.Lock()

    def key(self, *parts: object) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    # --- sessions ---------------------------------------------------------------------------

    def create_session(self, meta: dict) -> str:
        sid = f"s{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.redis.hset(
            self.key("session", sid), mapping={"meta": json.dumps(meta), "created": now, "seen": now}
        )
        return sid

    def heartbeat(self, sid: str) -> bool:
        key = self.key("session", sid)
        if not self.redis.exists(key):
            return False
        self.redis.hset(key, "seen", time.time())
        return True

    def finish_session(self, sid: str, reason: str) -> bool:
        """Whether `sid` is a session (then finished, with the first reason given)."""
        key = self.key("session", sid)
        if not self.redis.exists(key):
            return False
        self.redis.hsetnx(key, "finished", reason)
        return True

    def expire_session(self, sid: str) -> bool:
        """Finish `sid` as expired; whether this call ended it (it was not finished before)."""
        return bool(self.redis.hsetnx(self.key("session", sid), "finished", "expired"))

    def session(self, sid: str) -> dict | None:
        data = self.redis.hgetall(self.key("session", sid))
        return {k.decode(): v.decode() for k, v in data.items()} if data else None

    # --- models -----------------------------------------------------------------------------

    def model(self, mid: str) -> dict | None:
        data = self.redis.hget(self.key("model", mid), "record")
        return json.loads(data) if data else None

    def put_model(self, mid: str, record: dict) -> None:
        pipe = self.redis.pipeline(transaction=True)
        self._write_model(pipe, mid, record)
        pipe.execute()

    def _write_model(self, pipe, mid: str, record: dict) -> None:
        """The record, and the index of live models with it: every write of a record goes here,
        so `live_models` reads one set, not every model the namespace ever held."""
        pipe.hset(self.key("model", mid), "record", json.dumps(record))
        if record.get("status") == "live":
            pipe.sadd(self.key("live"), mid)
        else:
            pipe.srem(self.key("live"), mid)

    def update_model(self, mid: str, **changes) -> dict:
        with self._lock:
            record = self.model(mid) or {}
            record.update(changes)
            self.put_model(mid, record)
            return record

    def live_models(self) -> list[str]:
        return sorted(m.decode() for m in self.redis.smembers(self.key("live")))

    # --- commands ---------------------------------------------------------------------------

    def submit(
        self, mid: str, seq: int, kind: str, payload: dict, fp: str, model: dict | None = None
    ) -> tuple[str, bool]:
        """(the request id of command `seq` of model `mid`, whether it is new): the recorded one
        if this call was seen (same `fp`), else a new one, queued with `payload`. `model`
        creates the model's record with its first command (seq 0: create or load)."""
        seq_key = self.key("seq", mid, seq)
        with self._lock:
            existing = self.redis.get(seq_key)
            if existing is not None:
                rid = existing.decode()
                if rid == GAP:
                    raise SeqBehind(
                        f"seq id {seq} of model {mid} was given up: it arrived after the commands behind it failed"
                    )
                if self.redis.hget(self.key("future", rid), "fp").decode() != fp:
                    raise SeqConflict(
                        f"seq id {seq} of model {mid} is already used by a different call ({rid})"
                    )
                return rid, False
            record = self.model(mid) if model is None else model
            if model is None and (record or {}).get("status") != "live":  # read under the lock the
                # release's write takes: a call is queued before it (and failed by it) or refused
                raise ModelGone(f"model {mid} is {(record or {}).get('status', 'unknown')}")
            cursor = int(record.get("cursor", -1)) if record else -1
            if seq <= cursor:
                raise SeqBehind(
                    f"seq id {seq} of model {mid} is at or behind its cursor ({cursor}) and has no record "
                    "(given up, or its result expired)"
                )
            queue = self.key("queue", mid)
            if self.redis.zcard(queue) >= self.max_queued:
                raise QueueFull(f"model {mid} has {self.max_queued} commands waiting (max_queued_commands)")
            rid = f"r{uuid.uuid4().hex}"
            pipe = self.redis.pipeline(transaction=True)
            if model is not None:
                self._write_model(pipe, mid, model)
            pipe.hset(
                self.key("future", rid),
                mapping={
                    "state": QUEUED,
                    "model": mid,
                    "seq": seq,
                    "kind": kind,
                    "fp": fp,
                    "queued_at": time.time(),
                },
            )
            pipe.set(self.key("body", rid), json.dumps(payload))
            pipe.zadd(queue, {rid: seq})
            pipe.set(seq_key, rid)
            pipe.execute()
            return rid, True

    def queued(self, mid: str) -> list[Command]:
        """The model's commands not finished, in seq order."""
        out = []
        for rid_b, _ in self.redis.zrange(self.key("queue", mid), 0, -1, withscores=True):
            command = self.command(rid_b.decode())
            if command is not None:
                out.append(command)
        return out

    def command(self, rid: str) -> Command | None:
        data = self.redis.hgetall(self.key("future", rid))
        if not data or b"model" not in data:
            return None
        d = {k.decode(): v.decode() for k, v in data.items()}
        return Command(rid, d["model"], int(d["seq"]), d["kind"], d["state"], float(d["queued_at"]))

    def body(self, rid: str) -> dict:
        raw = self.redis.get(self.key("body", rid))
        if raw is None:
            raise KeyError(f"the body of {rid} is gone")
        return json.loads(raw)

    def head(self, mid: str) -> tuple[Command | None, int | None]:
        """(the command to run next, None) when the model's lowest waiting seq id is the one
        after its cursor; (None, the missing seq id) when it is further ahead; (None, None)
        when nothing waits."""
        first = self.redis.zrange(self.key("queue", mid), 0, 0, withscores=True)
        if not first:
            return None, None
        record = self.model(mid) or {}
        expected = int(record.get("cursor", -1)) + 1
        command = self.command(first[0][0].decode())
        if command is None:  # (a half-written record: never written by this class)
            self.redis.zrem(self.key("queue", mid), first[0][0])
            return None, None
        return (command, None) if command.seq <= expected else (None, expected)

    def start(self, command: Command) -> None:
        self.redis.hset(
            self.key("future", command.request_id), mapping={"state": RUNNING, "started_at": time.time()}
        )

    def finish(
        self,
        command: Command,
        *,
        result: dict | None = None,
        error: str | None = None,
        category: str = "user",
        model_changes: dict | None = None,
    ) -> None:
        """Record `command`'s result (or its failure) and move the model's cursor past it, in
        one transaction: a crash leaves it either running or finished, never half."""
        with self._lock:
            record = self.model(command.model_id) or {}
            record["cursor"] = max(int(record.get("cursor", -1)), command.seq)
            record.update(model_changes or {})
            fields = {"state": DONE, "result": json.dumps(result)} if error is None else {
                "state": FAILED, "error": error, "category": category}  # fmt: skip
            fields["finished_at"] = time.time()
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.key("future", command.request_id), mapping=fields)
            pipe.expire(self.key("future", command.request_id), self.ttl)
            pipe.expire(self.key("seq", command.model_id, command.seq), self.ttl)
            pipe.zrem(self.key("queue", command.model_id), command.request_id)
            pipe.delete(self.key("body", command.request_id))
            self._write_model(pipe, command.model_id, record)
            pipe.execute()

    def give_up_gap(self, mid: str, missing: int, reason: str) -> list[Command]:
        """Give up seq ids `missing` .. (the lowest waiting one - 1): their keys become `GAP`,
        every waiting command fails with `reason`, and the cursor moves past them."""
        waiting = self.queued(mid)
        if not waiting:
            return []
        top = max(c.seq for c in waiting)
        with self._lock:
            pipe = self.redis.pipeline(transaction=True)
            for seq in range(missing, min(c.seq for c in waiting)):
                pipe.set(self.key("seq", mid, seq), GAP, nx=True, ex=self.ttl)
            pipe.execute()
        for command in waiting:
            self.finish(command, error=reason)
        self.update_model(mid, cursor=top)
        return waiting

    # --- futures that are not model commands (samples) --------------------------------------

    def new_future(self, kind: str, meta: dict | None = None) -> str:
        rid = f"r{uuid.uuid4().hex}"
        mapping = {"state": RUNNING, "kind": kind, "queued_at": time.time(), **(meta or {})}
        self.redis.hset(self.key("future", rid), mapping=mapping)
        self.redis.expire(self.key("future", rid), self.ttl)
        return rid

    def settle(
        self, rid: str, *, result: dict | None = None, error: str | None = None, category: str = "user"
    ) -> None:
        fields = {"state": DONE, "result": json.dumps(result)} if error is None else {
            "state": FAILED, "error": error, "category": category}  # fmt: skip
        fields["finished_at"] = time.time()
        self.redis.hset(self.key("future", rid), mapping=fields)
        self.redis.expire(self.key("future", rid), self.ttl)

    def future(self, rid: str) -> dict | None:
        data = self.redis.hgetall(self.key("future", rid))
        if not data:
            return None
        out = {k.decode(): v.decode() for k, v in data.items()}
        if "result" in out:
            out["result"] = json.loads(out["result"])
        return out

    # --- named records: checkpoints and sampling sessions -----------------------------------

    def put_record(self, kind: str, name: str, record: dict, *, expires: bool = False) -> None:
        """`expires`: kept `result_ttl_s`, as a finished call's result (an unnamed sampler save's
        records: its adapter is pruned too); else kept until deleted."""
        self.redis.set(self.key(kind, name), json.dumps(record), ex=self.ttl if expires else None)

    def record(self, kind: str, name: str) -> dict | None:
        raw = self.redis.get(self.key(kind, name))
        return json.loads(raw) if raw else None
