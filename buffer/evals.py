"""Evaluation records in Redis: summaries, items, and a lease queue that survives a dead replica.

Keys, under the run's hash tag (`asyncrl:{run}:…`, single-slot like every other key):
* `evals` hash: eval_id → summary JSON (`proto.evals.EvalSummary`); listing reads only this.
* `eval:<id>` hash: `task` (JSON `EvalTask`: tokenized prompts, sampling params), `items`
  (JSON list of `EvalItem`, written with the final summary), `owner`, `attempts`.
* `evalq` sorted set: every evaluation not finished, scored by the Redis time (ms) at which
  anyone may claim it: its creation time while queued, `now + lease` while a runner holds it.

Guarantees: `create` is atomic and idempotent on eval_id (summary, task and queue entry appear
together or not at all). `claim` hands an evaluation to one runner at a time; a runner that
stops heartbeating (`touch`) loses it when its lease runs out, and the next `claim` anywhere
gets it again with `attempts` counting the claims. `set_running` and `finish` write only for
the current owner, and `finish` takes the evaluation off the queue in the same script: a
finished evaluation is never claimed again, and a runner that lost its lease cannot
overwrite the new owner's result. Times come from the Redis server (`TIME`), so replicas'
clocks do not matter. Values are JSON; nothing is pickled.

Not guaranteed: a recovered evaluation starts over (items of the dead run are not kept), and
nothing here expires: a run keeps every evaluation it made.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from pydantic import TypeAdapter, ValidationError

from asyncrl.buffer.connection import (
    CLUSTER_RETRY_ERRORS,
    RETRY_ERRORS,
    Keys,
    ReconnectRetry,
    is_cluster_url,
    open_client,
)
from asyncrl.proto.evals import EvalItem, EvalSummary, EvalTask
from asyncrl.proto.states import JobState

_NOW_MS = (
    "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
)

# KEYS: evals, evalq, eval:<id>; ARGV: id, summary, task, owner ('' = queued), lease_ms
CREATE = (
    _NOW_MS
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[3], 'task', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[3], 'owner', ARGV[4], 'attempts', 1)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[1])
else
  redis.call('ZADD', KEYS[2], now, ARGV[1])
end
return 1
"""
)

# KEYS: evalq, evals, eval key prefix; ARGV: owner, lease_ms
CLAIM = (
    _NOW_MS
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
if #ids == 0 then return false end
local id = ids[1]
local key = KEYS[3] .. id
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
redis.call('HSET', key, 'owner', ARGV[1])
local attempts = redis.call('HINCRBY', key, 'attempts', 1)
return {id, redis.call('HGET', KEYS[2], id) or '', redis.call('HGET', key, 'task') or '', attempts}
"""
)

# KEYS: evalq, eval key prefix; ARGV: owner, lease_ms, ids… → the ids this owner no longer holds
TOUCH = (
    _NOW_MS
    + """
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[2] .. id, 'owner') == ARGV[1] and redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
  else
    lost[#lost + 1] = id
  end
end
return lost
"""
)

# KEYS: evals, evalq, eval:<id>; ARGV: owner, id, summary, final ('1' | '0'), items
WRITE = """
if redis.call('HGET', KEYS[3], 'owner') ~= ARGV[1] or not redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[3], 'items', ARGV[5])
  redis.call('HDEL', KEYS[3], 'owner')
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return 1
"""

_ITEMS = TypeAdapter(list[EvalItem])


@dataclass
class ClaimedEval:
    """An evaluation a runner holds. `task` is None when its stored record does not decode
    (the runner fails it with `problem` as the reason)."""

    summary: EvalSummary
    task: EvalTask | None
    attempts: int
    problem: str = ""


class EvalStore:
    """One run's evaluations. Thread-safe (one redis-py client with its connection pool)."""

    def __init__(self, redis_url: str, run: str = "default", *, client: redis.Redis | None = None):
        p = Keys(run).prefix
        self.evals, self.queue, self.prefix = p + "evals", p + "evalq", p + "eval:"
        errors = CLUSTER_RETRY_ERRORS if is_cluster_url(redis_url) else RETRY_ERRORS
        self.redis = client or open_client(
            redis_url, ReconnectRetry("evals", errors=errors), decode_responses=True, socket_keepalive=True
        )  # buffer/connection.py (one Redis, or a cluster: every key carries the run's tag)
        self._create, self._claim, self._touch, self._write = (
            self.redis.register_script(s) for s in (CREATE, CLAIM, TOUCH, WRITE)
        )

    def close(self) -> None:
        self.redis.close()

    def create(self, summary: EvalSummary, task: EvalTask, owner: str = "", lease_s: float = 0.0) -> bool:
        """Store a new evaluation, queued, or held by `owner` for `lease_s` (a runner that starts
        it at once). False, and nothing written, when `summary.eval_id` exists already."""
        keys = [self.evals, self.queue, self.prefix + summary.eval_id]
        args = [
            summary.eval_id,
            summary.model_dump_json(),
            task.model_dump_json(),
            owner,
            int(lease_s * 1000),
        ]
        return bool(self._create(keys=keys, args=args))

    def claim(self, owner: str, lease_s: float) -> ClaimedEval | None:
        """The oldest queued evaluation, or one whose holder's lease ran out; None if none."""
        got = self._claim(keys=[self.queue, self.evals, self.prefix], args=[owner, int(lease_s * 1000)])
        if not got:
            return None
        eval_id, summary_json, task_json, attempts = got
        try:
            summary = EvalSummary.model_validate_json(summary_json)
        except ValidationError as exc:
            summary = EvalSummary(
                eval_id=eval_id,
                name="unknown",
                source="api",
                state=JobState.queued,
                prompts=0,
                created_at=0.0,
            )
            return ClaimedEval(
                summary, None, int(attempts), f"stored summary does not decode: {exc.errors()[:1]}"
            )
        try:
            return ClaimedEval(summary, EvalTask.model_validate_json(task_json), int(attempts))
        except ValidationError as exc:
            return ClaimedEval(
                summary, None, int(attempts), f"stored task does not decode: {exc.errors()[:1]}"
            )

    def touch(self, owner: str, eval_ids: list[str], lease_s: float) -> list[str]:
        """Extend `owner`'s leases; returns the ids it no longer holds (reclaimed or finished)."""
        if not eval_ids:
            return []
        return list(self._touch(keys=[self.queue, self.prefix], args=[owner, int(lease_s * 1000), *eval_ids]))

    def set_running(self, owner: str, summary: EvalSummary) -> bool:
        """Replace the summary (state `running`); False if `owner` does not hold the evaluation."""
        return self._write_summary(owner, summary, None)

    def finish(self, owner: str, summary: EvalSummary, items: list[EvalItem]) -> bool:
        """Store the final summary (`done` or `failed`) and the items, and dequeue, in one
        script; False (nothing written) if `owner` does not hold the evaluation."""
        return self._write_summary(owner, summary, items)

    def _write_summary(self, owner: str, summary: EvalSummary, items: list[EvalItem] | None) -> bool:
        final = items is not None
        keys = [self.evals, self.queue, self.prefix + summary.eval_id]
        args = [
            owner,
            summary.eval_id,
            summary.model_dump_json(),
            "1" if final else "0",
            _ITEMS.dump_json(items or []).decode(),
        ]
        return bool(self._write(keys=keys, args=args))

    def summary(self, eval_id: str) -> EvalSummary | None:
        raw = self.redis.hget(self.evals, eval_id)
        return EvalSummary.model_validate_json(raw) if raw else None

    def get(self, eval_id: str) -> tuple[EvalSummary, list[EvalItem]] | None:
        """The summary and the items (empty until finished), read in one transaction."""
        pipe = self.redis.pipeline(transaction=True)
        summary, items = pipe.hget(self.evals, eval_id).hget(self.prefix + eval_id, "items").execute()
        if not summary:
            return None
        return EvalSummary.model_validate_json(summary), _ITEMS.validate_json(items) if items else []

    def list(self, name: str | None = None) -> list[EvalSummary]:
        """Every summary (of `name`), ordered by version, then creation; queued ones last."""
        out = [EvalSummary.model_validate_json(raw) for raw in self.redis.hvals(self.evals)]
        if name is not None:
            out = [s for s in out if s.name == name]
        return sorted(out, key=lambda s: (s.version is None, s.version or 0, s.created_at, s.eval_id))
