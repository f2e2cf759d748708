"""The groups stream: where a scored group's state lives and changes (docs/architecture.md §4).

A group is put once (`put`, idempotent on group_id) and leaves the buffer exactly once, counted:
`ack` (trained; called when the checkpoint covering it is durable), staleness in `take`
(dropped or withheld), a token from an abandoned history in `take` (lost), `discard`
(zero_spread), or the dead-letter stream (its payload is missing or does not decode).

Its state is its field in `groups:state` (`proto.states.GroupState`): `buffered` from the put,
then the state it left by. While buffered, `groups:entry` holds its stream entry id,
`groups:job` its job id and `payload:<group_id>` its encoded record. Each transition is one of
the scripts below, and each is taken only from `buffered`, so a redelivery or a re-sent call
changes nothing twice (buffer/connection.py). A `Groups` holds what its consumer was handed:
one per consumer thread; any number of processes.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field

from asyncrl.buffer import metrics as m
from asyncrl.buffer.connection import ORPHAN_TTL_MS, TRAINER_GROUP, Buffer, Part, Script
from asyncrl.buffer.versions import PolicyVersions
from asyncrl.proto import Group, RecordDecodeError, decode, encode
from asyncrl.proto.lineage import Lineage
from asyncrl.proto.states import GroupState

STALE_STREAM_MAXLEN = 10_000  # the `stale` stream is for inspection; cap it
DEADLETTER_MAXLEN = 100_000  # far above any sane rate of bad records; the counter is exact anyway
STALENESS_POLICIES = ("drop", "withhold")
DISCARD_REASONS = (GroupState.zero_spread,)

# A script that handles many groups makes one command per kind of update, not one per group (a
# `redis.call` costs ~3.5 µs, more than the rest of a put per group). `unpack` is bounded by Lua's
# C stack, so `sliced(items, cmd, ...)` calls `cmd ... items[s..s+999]` per slice and joins replies.
_SLICED = """
local function sliced(items, cmd, ...)
  local head, out = {cmd, ...}, {}
  for s = 1, #items, 1000 do
    local args = {unpack(head)}
    for j = s, math.min(s + 999, #items) do args[#args + 1] = items[j] end
    local part = redis.call(unpack(args))
    if type(part) == 'table' then for j = 1, #part do out[#out + 1] = part[j] end end
  end
  return out
end
"""

# `puts`: group_id, job_id, min_version per group. One flag per group: 1 new, 0 seen before and
# still buffered, -1 seen before and left already (a group_id twice in one call is put once). The
# payloads were written by `SET NX` in the same pipeline, one MULTI/EXEC on one Redis (~200 kB
# through a Lua argument costs as much as the XADD; `Buffer.pipeline` says why MULTI); the entry
# holds the id and the oldest token version (for inspection). The group's admission slot moves
# from `running` to `accepted`. On a cluster `payloads` is empty (the payloads live in other
# slots): the caller deletes those of the -1 groups itself.
PUT = Script(
    "state entry job groups admission stats running *payloads",
    "*puts",
    _SLICED
    + """
local gids = {}
for i = 1, #puts / 3 do gids[i] = puts[3 * i - 2] end
sliced(gids, 'HDEL', running)
local states = sliced(gids, 'HMGET', state)
local out, seen, new_states, new_entries, new_jobs = {}, {}, {}, {}, {}
for i, gid in ipairs(gids) do
  out[i] = 0
  if states[i] then
    -- it left the buffer already: the SET NX just wrote its payload again
    if states[i] ~= 'buffered' then
      out[i] = -1
      if payloads[i] then redis.call('DEL', payloads[i]) end
    end
  elseif not seen[gid] then
    seen[gid], out[i] = true, 1
    local eid = redis.call('XADD', groups, '*', 'gid', gid, 'mv', puts[3 * i])
    new_states[#new_states + 1], new_states[#new_states + 2] = gid, 'buffered'
    new_entries[#new_entries + 1], new_entries[#new_entries + 2] = gid, eid
    new_jobs[#new_jobs + 1], new_jobs[#new_jobs + 2] = gid, puts[3 * i - 1]
  end
end
local new = #new_states / 2
if new > 0 then
  sliced(new_states, 'HSET', state)
  sliced(new_entries, 'HSET', entry)
  sliced(new_jobs, 'HSET', job)
  redis.call('HINCRBY', admission, 'accepted', new)
  redis.call('HINCRBY', stats, 'put', new)
end
if new < #gids then redis.call('HINCRBY', stats, 'duplicates', #gids - new) end
return out
""",
)

# `buffered` → `exit` for each buffered group of `gids` (others, and repeats, are skipped): XACK
# and XDEL of its entry, payload unlinked (freed off Redis's main thread where it judges it
# worth it), counted in `stats` and in its job's hash. `trained` keeps its place in `accepted`;
# any other exit gives it back (never to be trained, it must not hold capacity). Returns how
# many left. (Job and payload keys are built from prefixes that carry the run's hash tag.) On
# a cluster `unlink` is 0: it returns the ids that left, and the caller unlinks their payloads.
EXIT = Script(
    "state entry job groups admission stats job_prefix payload_prefix stepped",
    "consumer_group exit unlink *gids",
    _SLICED
    + """
local states, entries, jobs_of = sliced(gids, 'HMGET', state), sliced(gids, 'HMGET', entry), sliced(gids, 'HMGET', job)
local marks = sliced(gids, 'HMGET', stepped)
local done, acks, payloads, moved, left, per_job, unmarked = {}, {}, {}, {}, {}, {}, {}
for i, gid in ipairs(gids) do
  if states[i] == 'buffered' and not done[gid] then
    done[gid] = true
    acks[#acks + 1], payloads[#payloads + 1], left[#left + 1] = entries[i], payload_prefix .. gid, gid
    moved[#moved + 1], moved[#moved + 2] = gid, exit
    local j = jobs_of[i]
    if j then
      per_job[j] = (per_job[j] or 0) + 1
      if marks[i] then unmarked[j] = (unmarked[j] or 0) + 1 end
    end
  end
end
if #left == 0 then return unlink == '1' and 0 or left end
sliced(acks, 'XACK', groups, consumer_group)
sliced(acks, 'XDEL', groups)
if unlink == '1' then sliced(payloads, 'UNLINK') end
sliced(moved, 'HSET', state)
sliced(left, 'HDEL', entry)
sliced(left, 'HDEL', job)
if next(unmarked) then sliced(left, 'HDEL', stepped) end
redis.call('HINCRBY', stats, exit, #left)
if exit ~= 'trained' then redis.call('HINCRBY', admission, 'accepted', -#left) end
for j, count in pairs(per_job) do redis.call('HINCRBY', job_prefix .. j, exit, count) end
for j, count in pairs(unmarked) do redis.call('HINCRBY', job_prefix .. j, 'stepped', -count) end
if unlink == '1' then return #left end
return left
""",
)

# An entry whose group has no payload or does not decode. It was just delivered, so it is pending:
# an XACK that finds nothing means this ran before (a re-sent call): nothing is dead-lettered
# twice. If it is the group's recorded entry, the group leaves as `dead_lettered` (slot given back)
# and this returns 2 (1 otherwise): on a cluster the caller then unlinks the payload (`payload`,
# the key in the run's slot, exists only on one Redis).
DEAD_LETTER = Script(
    "groups deadletter stats state entry job admission payload job_prefix stepped",
    "consumer_group eid gid reason data maxlen",
    """
if redis.call('XACK', groups, consumer_group, eid) == 0 then return 0 end
redis.call('XDEL', groups, eid)
redis.call('XADD', deadletter, 'MAXLEN', '~', maxlen, '*', 'stream', 'groups', 'entry', eid, 'gid', gid,
           'reason', reason, 'data', data)
redis.call('HINCRBY', stats, 'dead_lettered', 1)
if redis.call('HGET', entry, gid) == eid then
  redis.call('HSET', state, gid, 'dead_lettered')
  local job_id = redis.call('HGET', job, gid)
  if job_id then
    redis.call('HINCRBY', job_prefix .. job_id, 'dead_lettered', 1)
    if redis.call('HDEL', stepped, gid) == 1 then redis.call('HINCRBY', job_prefix .. job_id, 'stepped', -1) end
  end
  redis.call('HDEL', entry, gid)
  redis.call('HDEL', job, gid)
  redis.call('UNLINK', payload)
  redis.call('HINCRBY', admission, 'accepted', -1)
  return 2
end
return 1
""",
)


# The trainer's optimizer step has used these buffered groups (the update is not durable until
# the checkpoint that acks them). Marked once per group (a step replayed after a restart marks
# nothing twice), counted in its job's hash as `stepped` until the group leaves the buffer, when
# EXIT or DEAD_LETTER take the mark back: a job's progress shows a group trained from its step
# on, and counts it once whether it was then acked, or redelivered and dropped after a crash.
STEPPED = Script(
    "state job stepped job_prefix",
    "version *gids",
    _SLICED
    + """
local states, jobs_of = sliced(gids, 'HMGET', state), sliced(gids, 'HMGET', job)
local marked = 0
for i, gid in ipairs(gids) do
  if states[i] == 'buffered' and jobs_of[i] and redis.call('HSETNX', stepped, gid, version) == 1 then
    redis.call('HINCRBY', job_prefix .. jobs_of[i], 'stepped', 1)
    marked = marked + 1
  end
end
return marked
""",
)


@dataclass
class TakeResult:
    groups: list[Group] = field(default_factory=list)
    withheld: list[Group] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # too stale (policy `drop`)
    lost: list[str] = field(default_factory=list)  # sampled by weights of a lost history
    dead_lettered: int = 0
    staleness: list[int] = field(default_factory=list)


class Groups:
    """One run's groups, as one consumer sees them. `consumer` must be stable across restarts of
    the same worker (its pending entries are its own); a producer needs none."""

    def __init__(self, buf: Buffer, consumer: str | None = None):
        self.buf, self.keys = buf, buf.keys
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self._outages_seen = buf.retry.outages
        self._redelivery: deque[tuple[str, dict]] = deque()
        # Entries this consumer holds (delivered, not yet left): recovery must not hand them out
        # again, or a trainer would train a group twice.
        self._held: dict[str, str] = {}  # group_id -> entry id

    # ------------------------------------------------------------------ producer side
    def put(self, groups: list[Group]) -> list[bool]:
        """Append scored groups in one round trip; one flag per group, True if new (a group_id
        seen before is a counted duplicate and changes nothing)."""
        return self.buf.pipeline_parts(self.put_part(groups))[0] if groups else []

    def put_part(self, groups: list[Group]) -> Part:
        """`put` as part of a larger pipeline (`Buffer.pipeline_parts`)."""
        t0 = time.perf_counter()
        k = self.keys
        payloads, payload_keys, puts = [], [], []
        for group in groups:
            if not group.scored:
                raise ValueError(f"group {group.group_id} has samples without a reward status")
            payloads.append(encode(group))
            payload_keys.append(self.buf.payload_key(group.group_id))
            puts += [group.group_id, group.job_id, group.min_version]
        cluster = self.buf.cluster is not None
        if cluster:
            # Before the group is recorded (a take must find its payload), and with a TTL: a put
            # cut off before PUT leaves no payload for ever; `finish` keeps the recorded ones.
            self.buf.payload_commands(
                [
                    ("SET", key, payload, "NX", "PX", ORPHAN_TTL_MS)
                    for key, payload in zip(payload_keys, payloads)
                ]
            )

        def fill(pipe) -> None:
            if not cluster:
                for key, payload in zip(payload_keys, payloads):
                    pipe.execute_command("SET", key, payload, "NX")
            self.buf.call(
                PUT,
                pipe,
                state=k.group_state,
                entry=k.group_entry,
                job=k.group_job,
                groups=k.groups,
                admission=k.admission,
                stats=k.stats,
                running=k.running,
                payloads=[] if cluster else payload_keys,
                puts=puts,
            )

        def finish(replies: list) -> list[bool]:
            flags = [int(flag) for flag in replies[-1]]
            if cluster:  # buffered: keep the payload (no TTL); left before: the SET NX wrote it again
                self.buf.payload_commands(
                    [("UNLINK" if f < 0 else "PERSIST", key) for f, key in zip(flags, payload_keys)]
                )
            new = [flag == 1 for flag in flags]
            m.PUT_BYTES.inc(sum(len(payload) for is_new, payload in zip(new, payloads) if is_new))
            if not all(new):
                m.DUPLICATES.inc(new.count(False))
            elapsed = time.perf_counter() - t0
            for _ in groups:
                m.PUT_SECONDS.observe(elapsed / len(groups))
            return new

        return Part(fill, finish, transaction=not cluster)

    # ------------------------------------------------------------------ consumer side
    def take(
        self, n: int, current_version: int, max_staleness: int = 0, block_ms: int = 1000, policy: str = "drop"
    ) -> TakeResult:
        """Up to `n` groups with `current_version − min_version ≤ max_staleness`, waiting up to
        `block_ms`. Stale groups leave at once (counted; `withhold` also returns them in
        `withheld` for group statistics); groups with a token from a lost history (a trainer
        resumed from an older checkpoint, proto/lineage.py) leave as `lost`; ones without a
        decodable payload go to the dead-letter stream. Groups claimed by `recover` come first."""
        if policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness policy must be one of {STALENESS_POLICIES}, got {policy!r}")
        t0 = time.perf_counter()
        deadline = time.monotonic() + block_ms / 1000
        out = TakeResult()
        stale_hist: dict[int, int] = {}
        history: Lineage | None = None
        while len(out.groups) < n:
            entries = self._next_entries(n - len(out.groups), deadline)
            if not entries:
                break
            keys = [self.buf.payload_key(f.get(b"gid", b"").decode(errors="replace")) for _, f in entries]
            if history is None:  # read once per take, after the wait, with the first payloads
                payloads, (history,) = self.buf.payload_get(keys, PolicyVersions(self.buf).lineage_part())
            else:
                payloads, _ = self.buf.payload_get(keys)
            for (eid, fields), data in zip(entries, payloads):
                group = self._decode(eid, fields, data, out)
                if group is None:
                    continue
                self._held[group.group_id] = eid
                if history.forks and history.lost(sampled_lineage(group)):
                    self._exit_stale(group.group_id, GroupState.lost, data)
                    out.lost.append(group.group_id)
                    m.DROPPED.labels("lost").inc()
                    continue
                staleness = current_version - group.min_version
                m.STALENESS.observe(max(staleness, 0))
                stale_hist[staleness] = stale_hist.get(staleness, 0) + 1
                if staleness <= max_staleness:
                    out.groups.append(group)
                    out.staleness.append(staleness)
                elif policy == "withhold":
                    self._exit_stale(group.group_id, GroupState.withheld, data)
                    out.withheld.append(group)
                    m.WITHHELD.inc()
                else:
                    self._exit_stale(group.group_id, GroupState.dropped, data)
                    out.dropped.append(group.group_id)
                    m.DROPPED.labels("stale").inc()
        if stale_hist:
            pipe = self.buf.redis.pipeline(transaction=False)
            for s, c in stale_hist.items():
                pipe.hincrby(self.keys.staleness, str(s), c)
            pipe.xlen(self.keys.groups)
            m.DEPTH.labels("groups").set(pipe.execute()[-1])
        m.TAKE_SECONDS.observe(time.perf_counter() - t0)
        return out

    def depth(self) -> int:
        """Entries in the groups stream: put and not yet out of the buffer (an exit, trained or
        dropped, deletes its entry), whether delivered to a trainer or not."""
        return self.buf.redis.xlen(self.keys.groups)

    def stepped(self, group_ids: list[str], version: int) -> int:
        """The optimizer step of `version` trained these groups (not durable yet: `ack` follows
        at the checkpoint). Shown in their jobs' progress; idempotent; returns how many are new."""
        if not group_ids:
            return 0
        k = self.keys
        return int(
            self.buf.call(
                STEPPED,
                state=k.group_state,
                job=k.group_job,
                stepped=k.group_stepped,
                job_prefix=k.job_prefix,
                version=version,
                gids=group_ids,
            )
        )

    def ack(self, group_ids: list[str]) -> int:
        """The groups are trained (call once the checkpoint covering them is durable). Idempotent;
        returns how many left the buffer now."""
        return self._exit(group_ids, GroupState.trained)

    def discard(self, group_ids: list[str], reason: GroupState) -> int:
        """Take groups out of training for a counted reason (`DISCARD_REASONS`). Idempotent."""
        reason = GroupState(reason)
        if reason not in DISCARD_REASONS:
            raise ValueError(
                f"invalid discard reason {reason!r}: one of {[r.value for r in DISCARD_REASONS]}"
            )
        n = self._exit(group_ids, reason)
        if n:
            m.DROPPED.labels(reason.value).inc(n)
        return n

    def recover(self, idle_ms: int) -> int:
        """Claim groups pending (delivered, not left) for ≥ idle_ms, e.g. those of a dead trainer
        or of this consumer before a restart; the next `take` returns them first."""
        held = set(self._held.values()) | {eid for eid, _ in self._redelivery}
        claimed = [
            e
            for e in self.buf.autoclaim(self.keys.groups, TRAINER_GROUP, self.consumer, idle_ms)
            if e[0] not in held
        ]
        self._redelivery.extend(claimed)
        return len(claimed)

    def sweep_payloads(self) -> int:
        """Cluster only (0 on one Redis): delete the payloads of groups that left the buffer. An
        exit writes the group's state first and unlinks its payload after (the two live in
        different slots); a crash between them leaves the payload behind, found here by `SCAN`
        on every master. A payload whose group is not recorded yet (a put in flight, or cut off)
        carries a TTL and is left alone. Returns how many were deleted (also counted)."""
        if not self.buf.cluster:
            return 0
        pattern, swept = self.buf.payload_key("*"), 0
        head = len(self.buf.payload_key(""))
        for node in self.buf.redis.get_primaries():
            client = self.buf.redis.get_redis_connection(node)
            for chunk in _chunks(client.scan_iter(match=pattern, count=1000), 1000):
                gids = [key[head - 1 : -1].decode(errors="replace") for key in chunk]
                states = self.buf.redis.hmget(self.keys.group_state, gids)
                gone = [
                    key for key, state in zip(chunk, states) if state is not None and state != b"buffered"
                ]
                if gone:
                    self.buf.payload_commands([("UNLINK", key) for key in gone])
                    swept += len(gone)
        m.ORPHAN_PAYLOADS.inc(swept)
        return swept

    # ------------------------------------------------------------------ internals
    def _next_entries(self, count: int, deadline: float) -> list[tuple[str, dict]]:
        if self.buf.retry.outages != self._outages_seen:
            self._outages_seen = self.buf.retry.outages
            self._reclaim_own()
        if self._redelivery:
            return [self._redelivery.popleft() for _ in range(min(count, len(self._redelivery)))]
        block_ms = max(int((deadline - time.monotonic()) * 1000), 0)
        return self.buf.read(self.keys.groups, TRAINER_GROUP, self.consumer, count=count, block_ms=block_ms)

    def _reclaim_own(self) -> None:
        """After a Redis outage: an `XREADGROUP` that ran on the server but whose reply was lost
        left entries in this consumer's pending list that it never saw. Hand those (and only
        those: not the ones it holds) out next, so nothing waits for a restart."""
        held = set(self._held.values()) | {eid for eid, _ in self._redelivery}
        unseen = [
            e for e in self.buf.read(self.keys.groups, TRAINER_GROUP, self.consumer, "0") if e[0] not in held
        ]
        self._redelivery.extend(unseen)
        m.RECLAIMED_AFTER_OUTAGE.inc(len(unseen))

    def _decode(self, eid: str, fields: dict, data: bytes | None, out: TakeResult) -> Group | None:
        """The entry's group, or None after moving the entry to the dead-letter stream."""
        gid = fields.get(b"gid", b"").decode(errors="replace")
        try:
            if data is None:
                raise RecordDecodeError("the group's payload is missing")
            return decode(data, Group)
        except RecordDecodeError as exc:
            k = self.keys
            moved = self.buf.call(
                DEAD_LETTER,
                groups=k.groups,
                deadletter=k.deadletter,
                stats=k.stats,
                state=k.group_state,
                entry=k.group_entry,
                job=k.group_job,
                admission=k.admission,
                payload=k.payload_prefix + gid,
                job_prefix=k.job_prefix,
                stepped=k.group_stepped,
                consumer_group=TRAINER_GROUP,
                eid=eid,
                gid=gid,
                reason=exc.reason,
                data=data or b"",
                maxlen=DEADLETTER_MAXLEN,
            )
            if moved == 2 and self.buf.cluster:  # the group left: its payload (if any) goes too
                self.buf.payload_commands([("UNLINK", self.buf.payload_key(gid))])
            if moved:  # (0: a re-sent call found it done: counted the first time)
                m.DEAD_LETTERED.labels("groups").inc()
                out.dead_lettered += 1
            return None

    def _exit(self, group_ids: list[str], exit: GroupState) -> int:
        if not group_ids:
            return 0
        for gid in group_ids:
            self._held.pop(gid, None)
        k = self.keys
        left = self.buf.call(
            EXIT,
            state=k.group_state,
            entry=k.group_entry,
            job=k.group_job,
            groups=k.groups,
            admission=k.admission,
            stats=k.stats,
            job_prefix=k.job_prefix,
            payload_prefix=k.payload_prefix,
            stepped=k.group_stepped,
            consumer_group=TRAINER_GROUP,
            exit=exit.value,
            unlink=0 if self.buf.cluster else 1,
            gids=group_ids,
        )
        if not self.buf.cluster:
            return int(left)
        if left:  # (a crash before this leaves orphans: `sweep_payloads`)
            self.buf.payload_commands([("UNLINK", self.buf.payload_key(g.decode())) for g in left])
        return len(left)

    def _exit_stale(self, group_id: str, exit: GroupState, payload: bytes) -> None:
        """Leave untrained at `take`, and keep the payload in the `stale` stream for inspection."""
        if self._exit([group_id], exit):
            self.buf.redis.xadd(
                self.keys.stale,
                {"gid": group_id, "reason": exit.value, "data": payload},
                maxlen=STALE_STREAM_MAXLEN,
                approximate=True,
            )


def sampled_lineage(group: Group) -> dict[int, int]:
    """`Group.lineage`, or for a group written before lineage existed: all of epoch 0."""
    if group.lineage:
        return group.lineage
    versions = group.samples.versions
    return {0: int(versions.max())} if len(versions) else {}


def _chunks(items, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
