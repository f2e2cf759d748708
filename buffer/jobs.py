"""The jobs stream and each rollout job's record (docs/architecture.md §4).

A group to generate is a `GroupJob` in the `jobs` stream; its state is its field in
`jobs:state` (`proto.states.GroupState`): `queued` from `enqueue` (idempotent on group_id),
then, once, `buffered` (its group was put, now or before), `failed` or `cancelled` (`end`), or
`dead_lettered` (the record does not decode). While queued, `jobs:entry` holds its entry id.
Rollout replicas claim jobs as the consumer group `rollout`; a job stays pending until it
ends, so a dead replica's jobs are recovered by another (`recover`) or by itself after a
restart (`resume_own`). A `Jobs` holds what its consumer claimed: one per consumer thread.

Each job also has a hash, `job:<job_id>`: what it is (`groups`, `created_at`, `body_hash`),
the last rollout state of each group with its error and unscored samples (`report`), and how
many of its groups left the buffer by each exit (written by buffer/groups.py). `progress`
reads it back typed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field

from asyncrl.buffer import metrics as m
from asyncrl.buffer.connection import ROLLOUT_GROUP, Buffer, Part, Script
from asyncrl.buffer.groups import DEADLETTER_MAXLEN
from asyncrl.proto import GroupJob, RecordDecodeError, decode, encode
from asyncrl.proto.states import JOB_ENDS, GroupState

ENQUEUE_CHUNK = 512  # jobs per pipeline
MAX_ERROR_CHARS = 500  # of a group's error in its job's record

ENQUEUE = Script(
    "state entry jobs stats",
    "group_id data",
    """
if redis.call('HEXISTS', state, group_id) == 1 then return 0 end
redis.call('HSET', state, group_id, 'queued')
redis.call('HSET', entry, group_id, redis.call('XADD', jobs, '*', 'gid', group_id, 'data', data))
redis.call('HINCRBY', stats, 'jobs_enqueued', 1)
return 1
""",
)

# Per group of `ends` (group_id, final, n, then n field/value pairs for its job's record, the
# key in `records`): the record's fields written, then `queued` → `final` (buffered, failed or
# cancelled), once: the entry is acked and deleted. One command for a batch of groups.
END = Script(
    "state entry jobs stats *records",
    "consumer_group *ends",
    """
local out, i = {}, 1
for r = 1, #records do
  local group_id, final, n = ends[i], ends[i + 1], tonumber(ends[i + 2])
  local fields = {}
  for j = 1, 2 * n do fields[j] = ends[i + 2 + j] end
  i = i + 3 + 2 * n
  redis.call('HSET', records[r], unpack(fields))
  out[r] = 0
  if redis.call('HGET', state, group_id) == 'queued' then
    local eid = redis.call('HGET', entry, group_id)
    redis.call('XACK', jobs, consumer_group, eid)
    redis.call('XDEL', jobs, eid)
    redis.call('HSET', state, group_id, final)
    redis.call('HDEL', entry, group_id)
    redis.call('HINCRBY', stats, 'jobs_' .. final, 1)
    out[r] = 1
  end
end
return out
""",
)

# As the groups stream's (buffer/groups.py): guarded by its XACK, so a re-sent call does nothing.
DEAD_LETTER = Script(
    "jobs deadletter stats state entry",
    "consumer_group eid gid reason data maxlen",
    """
if redis.call('XACK', jobs, consumer_group, eid) == 0 then return 0 end
redis.call('XDEL', jobs, eid)
redis.call('XADD', deadletter, 'MAXLEN', '~', maxlen, '*', 'stream', 'jobs', 'entry', eid, 'gid', gid,
           'reason', reason, 'data', data)
redis.call('HINCRBY', stats, 'dead_lettered', 1)
if redis.call('HGET', entry, gid) == eid then
  redis.call('HSET', state, gid, 'dead_lettered')
  redis.call('HDEL', entry, gid)
end
return 1
""",
)


@dataclass
class ClaimedJob:
    entry_id: str
    job: GroupJob


@dataclass
class GroupReport:
    """What the rollout records of one group in its job's hash."""

    job_id: str
    group_id: str
    state: GroupState  # generating | scoring | buffered | failed | cancelled
    error: str = ""  # why it failed, or why no sample of it was scored
    unscored: dict[str, int] | None = None  # its samples by reward status, when any was not scored


@dataclass
class JobProgress:
    """A rollout job's record, typed."""

    groups: int
    created_at: float
    body_hash: str
    cancel_requested: bool
    states: dict[str, GroupState] = field(default_factory=dict)  # group_id -> last reported state
    errors: dict[str, str] = field(default_factory=dict)  # group_id -> error
    unscored: dict[str, dict[str, int]] = field(default_factory=dict)  # group_id -> samples by reward status
    exits: dict[GroupState, int] = field(default_factory=dict)  # how its groups left the buffer
    stepped: int = 0  # buffered groups an optimizer step has trained, not yet acked by a checkpoint


class Jobs:
    """One run's rollout jobs, as one consumer (a rollout replica) sees them. `consumer` must be
    stable across restarts of the same replica; one that only enqueues or reads needs none."""

    def __init__(self, buf: Buffer, consumer: str | None = None):
        self.buf, self.keys = buf, buf.keys
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self._held: dict[str, str] = {}  # group_id -> entry id of the jobs this consumer works on

    # ------------------------------------------------------------------ the stream
    def enqueue(self, jobs: list[GroupJob]) -> int:
        """Queue groups for generation, ENQUEUE_CHUNK per round trip (each one atomic and
        idempotent on group_id). Returns how many were new."""
        k = self.keys
        new = 0
        for start in range(0, len(jobs), ENQUEUE_CHUNK):
            chunk = [(job.group_id, encode(job)) for job in jobs[start : start + ENQUEUE_CHUNK]]

            def fill(pipe, chunk=chunk) -> None:
                for group_id, data in chunk:
                    self.buf.call(
                        ENQUEUE,
                        pipe,
                        state=k.job_state,
                        entry=k.job_entry,
                        jobs=k.jobs,
                        stats=k.stats,
                        group_id=group_id,
                        data=data,
                    )

            new += sum(self.buf.pipeline(fill))
        return new

    def claim(self, n: int, block_ms: int = 1000) -> list[ClaimedJob]:
        return self._decode(
            self.buf.read(self.keys.jobs, ROLLOUT_GROUP, self.consumer, count=n, block_ms=block_ms)
        )

    def recover(self, idle_ms: int) -> list[ClaimedJob]:
        """Claim jobs another replica left pending for ≥ idle_ms (a dead replica's work)."""
        held = set(self._held.values())
        entries = self.buf.autoclaim(self.keys.jobs, ROLLOUT_GROUP, self.consumer, idle_ms)
        return self._decode([e for e in entries if e[0] not in held])

    def resume_own(self) -> list[ClaimedJob]:
        """After a restart under the same consumer name: the jobs this consumer had claimed."""
        held = set(self._held.values())
        return self._decode(
            [e for e in self.buf.read(self.keys.jobs, ROLLOUT_GROUP, self.consumer, "0") if e[0] not in held]
        )

    def touch(self, entry_ids: list[str]) -> None:
        """Reset the idle time of jobs still being worked on, so no one reclaims them."""
        if entry_ids:
            self.buf.redis.xclaim(self.keys.jobs, ROLLOUT_GROUP, self.consumer, 0, entry_ids, justid=True)

    def end(self, report: GroupReport) -> bool:
        """The group's job is over (`report.state`: buffered, failed or cancelled): record its last
        state, then take the job out of the stream, in one round trip. A crash before the end
        re-runs the job, which reports again. True if it ended now (not before)."""
        return self.end_many([report])[0]

    def end_many(self, reports: list[GroupReport]) -> list[bool]:
        """`end` for several groups' jobs in one round trip (each job's record written before
        its END, as `end` does); one flag per report."""
        return self.buf.pipeline_parts(self.end_part(reports))[0] if reports else []

    def end_part(self, reports: list[GroupReport]) -> Part:
        """`end_many` as part of a larger pipeline (`Buffer.pipeline_parts`)."""
        for report in reports:
            if report.state not in JOB_ENDS:
                raise ValueError(f"a job ends {[s.value for s in JOB_ENDS]}, not {report.state.value}")
        k = self.keys
        for report in reports:
            self._held.pop(report.group_id, None)

        ends: list = []
        for report in reports:
            fields = self._fields(report)
            ends += [
                report.group_id,
                report.state.value,
                len(fields),
                *(x for kv in fields.items() for x in kv),
            ]

        def fill(pipe) -> None:
            self.buf.call(
                END,
                pipe,
                state=k.job_state,
                entry=k.job_entry,
                jobs=k.jobs,
                stats=k.stats,
                records=[k.job_prefix + r.job_id for r in reports],
                consumer_group=ROLLOUT_GROUP,
                ends=ends,
            )

        return Part(fill, lambda replies: [bool(r) for r in replies[0]])

    def _decode(self, entries: list[tuple[str, dict]]) -> list[ClaimedJob]:
        claimed = []
        for eid, fields in entries:
            gid = fields.get(b"gid", b"").decode(errors="replace")
            try:
                if b"data" not in fields:
                    raise RecordDecodeError("stream entry has no 'data' field")
                job = decode(fields[b"data"], GroupJob)
            except RecordDecodeError as exc:
                k = self.keys
                moved = self.buf.call(
                    DEAD_LETTER,
                    jobs=k.jobs,
                    deadletter=k.deadletter,
                    stats=k.stats,
                    state=k.job_state,
                    entry=k.job_entry,
                    consumer_group=ROLLOUT_GROUP,
                    eid=eid,
                    gid=gid,
                    reason=exc.reason,
                    data=fields.get(b"data", b""),
                    maxlen=DEADLETTER_MAXLEN,
                )
                if moved:  # (0: a re-sent call found it done: counted the first time)
                    m.DEAD_LETTERED.labels("jobs").inc()
                continue
            self._held[job.group_id] = eid
            claimed.append(ClaimedJob(eid, job))
        return claimed

    # ------------------------------------------------------------------ the job's record
    def describe(self, job_id: str, groups: int, body_hash: str) -> None:
        """A new job: how many groups it has, when it came, and the hash of its request."""
        self.buf.redis.hset(
            self.keys.job_prefix + job_id,
            mapping={"groups": groups, "created_at": time.time(), "body_hash": body_hash},
        )

    def report(self, reports: list[GroupReport]) -> None:
        """Record groups' rollout states (one round trip)."""

        def fill(pipe) -> None:
            for r in reports:
                self._write(pipe, r)

        self.buf.pipeline(fill)

    def _write(self, pipe, r: GroupReport) -> None:
        pipe.hset(self.keys.job_prefix + r.job_id, mapping=self._fields(r))

    @staticmethod
    def _fields(r: GroupReport) -> dict[str, str]:
        """A report's fields in its job's record."""
        fields = {f"state:{r.group_id}": r.state.value}
        if r.error:
            fields[f"error:{r.group_id}"] = r.error[:MAX_ERROR_CHARS]
        if r.unscored:
            fields[f"unscored:{r.group_id}"] = json.dumps(r.unscored)
        return fields

    def progress(self, job_id: str) -> JobProgress | None:
        """The job's record, or None for a job never described."""
        raw, cancelled = (
            self.buf.redis.pipeline(transaction=False)
            .hgetall(self.keys.job_prefix + job_id)
            .sismember(self.keys.cancelled, job_id)
            .execute()
        )
        fields = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        if "groups" not in fields:
            return None
        out = JobProgress(
            int(fields["groups"]),
            float(fields.get("created_at", 0.0)),
            fields.get("body_hash", ""),
            bool(cancelled),
        )
        exits = {s.value: s for s in GroupState}
        for key, value in fields.items():
            kind, _, gid = key.partition(":")
            if kind == "state" and value in exits:
                out.states[gid] = exits[value]
            elif kind == "error":
                out.errors[gid] = value
            elif kind == "unscored":
                out.unscored[gid] = _statuses(value)
            elif key in exits and value.lstrip("-").isdigit():
                out.exits[exits[key]] = int(value)
            elif key == "stepped" and value.lstrip("-").isdigit():
                out.stepped = max(int(value), 0)
        return out

    def cancel(self, job_id: str) -> None:
        self.buf.redis.sadd(self.keys.cancelled, job_id)

    def cancelled(self, job_id: str) -> bool:
        return bool(self.buf.redis.sismember(self.keys.cancelled, job_id))


def _statuses(value: str) -> dict[str, int]:
    """An `unscored:<gid>` record (samples by reward status, JSON); {} if unreadable."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {str(k): v for k, v in parsed.items() if isinstance(v, int) and not isinstance(v, bool)}
