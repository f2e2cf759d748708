"""The gateway's sessions in Redis (services/rollout/gateway/, docs/architecture.md §12): who
belongs to which group, each session's chat calls as sampled, and when a reaper acts on a group.

Keys (all `asyncrl:{run}:` + …; every key of a group expires `KEY_TTL_FACTOR` × the TTL after
its last activity, so nothing outlives a reaper that never runs):

| key | type | contents |
|---|---|---|
| `gw:session:<sid>` | hash | `group_id`, `index`, `state` (open, closed, abandoned), `calls`, `engine`, `created_at`, `closed_at`, `result` (JSON reward result) |
| `gw:calls:<sid>` | list | one msgpack `proto.gateway.Call` per chat call, in the order they finished |
| `gw:group:<gid>` | hash | `state` (open, complete, put, abandoned), `size`, `prompt_id`, `spec` (JSON), `submit_version`, `created_at`, `opened`, `closed` |
| `gw:members:<gid>` | list | the group's session ids, in creation order |
| `gw:deadlines` | sorted set | group id → when (ms) a reaper acts on it: expiry, or the lease of the replica putting it |

A group is `open` while sessions join it (`OPEN`) and record calls (`RECORD`); the close of
its last session (`CLOSE`) makes it `complete` and leases it to that replica, which puts it in
the groups stream and marks it `put` (`FINISH`: its calls dropped, its hashes kept until their
TTL, so a late call or close is refused as closed, not unknown). A group past its deadline is
leased to the replica that claims it (`CLAIM`): a complete one is put by it, an open one (or one
that cannot be built) is dropped (`DROP`: its keys deleted, its admission slot in `running`
given back). A client that abandons a session of an open group (`ABANDON`) fails the whole group at
once: every session of it is marked `abandoned` and its calls deleted, its admission slot given
back, its deadline removed; the hashes stay until their TTL, so a sibling's later call or close is
refused as abandoned, and a repeated abandon answers that it was abandoned before.

Not guaranteed: a complete group whose keys expire before any reaper runs (every replica down
for `KEY_TTL_FACTOR` × the TTL) is lost, its admission slot given back when a reaper next runs.
Calls are recorded in the order they finish, not the order they were made.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.buffer.connection import Buffer, Script
from asyncrl.proto.gateway import Call

KEY_TTL_FACTOR = 2  # keys outlive their group's deadline, so a reaper that runs late still finds them

_CALL_ENCODER = msgspec.msgpack.Encoder()
_CALL_DECODER = msgspec.msgpack.Decoder(Call)


@dataclass
class ClosedSession:
    """A closed session of a complete group, as `SessionStore.group` reads it."""

    index: int
    calls: list[Call]
    result: dict[str, Any]  # {"reward", "status", "details"}
    closed_at: float


# `touch(gid)` refreshes the TTL of every key of a group (its hash, members, sessions, calls).
_TOUCH = """
local function touch(gid)
  local members = members_prefix .. gid
  redis.call('PEXPIRE', group_prefix .. gid, ttl_ms)
  redis.call('PEXPIRE', members, ttl_ms)
  for _, sid in ipairs(redis.call('LRANGE', members, 0, -1)) do
    redis.call('PEXPIRE', session_prefix .. sid, ttl_ms)
    redis.call('PEXPIRE', calls_prefix .. sid, ttl_ms)
  end
end
"""
_PREFIXES = "group_prefix members_prefix session_prefix calls_prefix ttl_ms"

# A session joins its group (created by the first session); refusals name what differs. A
# session id already taken answers 'exists' (two first calls of one named session race).
OPEN = Script(
    "group members session deadlines",
    f"{_PREFIXES} sid gid size prompt_id spec submit_version now deadline",
    _TOUCH
    + """
if redis.call('EXISTS', session) == 1 then return {'exists', sid} end
local state = redis.call('HGET', group, 'state')
if state then
  if state ~= 'open' then return {'complete', state} end
  local have = redis.call('HMGET', group, 'size', 'prompt_id', 'spec', 'opened')
  if have[1] ~= size then return {'size', have[1]} end
  if prompt_id ~= '' and have[2] ~= prompt_id then return {'prompt_id', have[2]} end
  if spec ~= '' and have[3] ~= spec then return {'spec', have[3]} end
  if tonumber(have[4]) >= tonumber(size) then return {'full', have[1]} end
else
  redis.call('HSET', group, 'state', 'open', 'size', size, 'prompt_id', prompt_id ~= '' and prompt_id or gid,
             'spec', spec, 'submit_version', submit_version, 'created_at', now, 'opened', 0, 'closed', 0)
end
local index = redis.call('HINCRBY', group, 'opened', 1) - 1
redis.call('RPUSH', members, sid)
redis.call('HSET', session, 'group_id', gid, 'index', index, 'state', 'open', 'created_at', now, 'calls', 0)
touch(gid)
redis.call('ZADD', deadlines, deadline, gid)
return {'ok', tostring(index)}
""",
)

# A finished call joins its session's calls, if the session is still open.
RECORD = Script(
    "session calls deadlines",
    f"{_PREFIXES} record engine deadline",
    _TOUCH
    + """
local s = redis.call('HMGET', session, 'state', 'group_id')
if not s[1] then return 'unknown' end
if s[1] ~= 'open' then return s[1] end
redis.call('RPUSH', calls, record)
redis.call('HINCRBY', session, 'calls', 1)
redis.call('HSET', session, 'engine', engine)
touch(s[2])
redis.call('ZADD', deadlines, 'XX', deadline, s[2])
return 'ok'
""",
)

# Close a session with its reward result. The close that closes the group's last session
# marks the group complete and takes the lease to put it ({'complete', gid}).
CLOSE = Script(
    "session deadlines",
    f"{_PREFIXES} result now deadline lease",
    _TOUCH
    + """
local s = redis.call('HMGET', session, 'state', 'group_id', 'calls')
if not s[1] then return {'unknown'} end
if s[1] ~= 'open' then return {s[1]} end
if tonumber(s[3]) == 0 then return {'empty'} end
redis.call('HSET', session, 'state', 'closed', 'result', result, 'closed_at', now)
local group = group_prefix .. s[2]
local closed = redis.call('HINCRBY', group, 'closed', 1)
touch(s[2])
if closed == tonumber(redis.call('HGET', group, 'size')) then
  redis.call('HSET', group, 'state', 'complete')
  redis.call('ZADD', deadlines, lease, s[2])
  return {'complete', s[2]}
end
redis.call('ZADD', deadlines, 'XX', deadline, s[2])
return {'open', s[2]}
""",
)

# The group is in the buffer: drop its calls, keep its hashes (a late call or close answers
# 409, not 404) until their TTL.
FINISH = Script(
    "group members deadlines",
    f"{_PREFIXES} gid",
    _TOUCH
    + """
if not redis.call('HGET', group, 'state') then return 0 end
redis.call('HSET', group, 'state', 'put')
for _, sid in ipairs(redis.call('LRANGE', members, 0, -1)) do redis.call('DEL', calls_prefix .. sid) end
touch(gid)
redis.call('ZREM', deadlines, gid)
return 1
""",
)

# Groups whose deadline passed, each leased to the caller until `lease` (ms): {gid, state, …}.
CLAIM = Script(
    "deadlines",
    "group_prefix now lease count",
    """
local out = {}
for _, gid in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now, 'LIMIT', 0, count)) do
  redis.call('ZADD', deadlines, lease, gid)
  out[#out + 1] = gid
  out[#out + 1] = redis.call('HGET', group_prefix .. gid, 'state') or ''
end
return out
""",
)

# Expire (or fail) a group still leased to the caller (any activity since moved its deadline):
# its admission slot is given back and its keys deleted. {opened, closed} or {} when not ours.
DROP = Script(
    "group members deadlines running",
    f"{_PREFIXES} gid lease",
    _TOUCH
    + """
if tonumber(redis.call('ZSCORE', deadlines, gid)) ~= tonumber(lease) then return {} end
local have = redis.call('HMGET', group, 'opened', 'closed')
for _, sid in ipairs(redis.call('LRANGE', members, 0, -1)) do
  redis.call('DEL', session_prefix .. sid, calls_prefix .. sid)
end
redis.call('DEL', group, members)
redis.call('ZREM', deadlines, gid)
redis.call('HDEL', running, gid)
return {tonumber(have[1] or '0'), tonumber(have[2] or '0')}
""",
)


# Abandon a session's group (any member of an open group may): {'abandoned', gid, opened,
# closed}; {'again', gid} when it was abandoned before; {state, gid} for a group no longer open
# (complete: being put; put); {'unknown'} without the session or its group.
ABANDON = Script(
    "session deadlines running",
    f"{_PREFIXES} now",
    _TOUCH
    + """
local gid = redis.call('HGET', session, 'group_id')
if not gid then return {'unknown'} end
local group = group_prefix .. gid
local state = redis.call('HGET', group, 'state')
if not state then return {'unknown'} end
if state == 'abandoned' then return {'again', gid} end
if state ~= 'open' then return {state, gid} end
local have = redis.call('HMGET', group, 'opened', 'closed')
for _, member in ipairs(redis.call('LRANGE', members_prefix .. gid, 0, -1)) do
  redis.call('HSET', session_prefix .. member, 'state', 'abandoned')
  redis.call('DEL', calls_prefix .. member)
end
redis.call('HSET', group, 'state', 'abandoned', 'abandoned_by', redis.call('HGET', session, 'index'),
           'abandoned_at', now)
touch(gid)
redis.call('ZREM', deadlines, gid)
redis.call('HDEL', running, gid)
return {'abandoned', gid, have[1], have[2]}
""",
)


class SessionStore:
    """One run's gateway sessions (keys in the module docstring); blocking calls, one round trip
    each but `group`. `ttl_s`: a group's idle time before it expires; `lease_s`: how long the
    replica that completed (or claimed) a group has to put it."""

    def __init__(self, buf: Buffer, ttl_s: float, lease_s: float):
        self.buf, self.keys = buf, buf.keys
        p = buf.keys.prefix + "gw:"
        self.session_prefix, self.calls_prefix = p + "session:", p + "calls:"
        self.group_prefix, self.members_prefix, self.deadlines = p + "group:", p + "members:", p + "deadlines"
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self._prefixes = {
            "group_prefix": self.group_prefix,
            "members_prefix": self.members_prefix,
            "session_prefix": self.session_prefix,
            "calls_prefix": self.calls_prefix,
            "ttl_ms": int(ttl_s * KEY_TTL_FACTOR * 1000),
        }

    def _deadline(self) -> int:
        return int((time.time() + self.ttl_s) * 1000)

    def new_lease(self, now: float | None = None) -> int:
        return int(((now or time.time()) + self.lease_s) * 1000)

    def group_exists(self, gid: str) -> bool:
        return bool(self.buf.redis.exists(self.group_prefix + gid))

    def open(
        self, sid: str, gid: str, size: int, prompt_id: str, spec: str, submit_version: int
    ) -> list[str]:
        raw = self.buf.call(
            OPEN,
            group=self.group_prefix + gid,
            members=self.members_prefix + gid,
            session=self.session_prefix + sid,
            deadlines=self.deadlines,
            sid=sid,
            gid=gid,
            size=size,
            prompt_id=prompt_id,
            spec=spec,
            submit_version=submit_version,
            now=time.time(),
            deadline=self._deadline(),
            **self._prefixes,
        )
        return [x.decode() for x in raw]

    def session(self, sid: str) -> dict[str, str]:
        """The session's hash (empty: no such session)."""
        return {k.decode(): v.decode() for k, v in self.buf.redis.hgetall(self.session_prefix + sid).items()}

    def spec(self, gid: str) -> str:
        """The group's reward spec as JSON ("": none)."""
        return (self.buf.redis.hget(self.group_prefix + gid, "spec") or b"").decode()

    def last_call(self, sid: str) -> Call | None:
        raw = self.buf.redis.lindex(self.calls_prefix + sid, -1)
        return None if raw is None else _CALL_DECODER.decode(raw)

    def record(self, sid: str, call: Call, engine: int) -> str:
        return self.buf.call(
            RECORD,
            session=self.session_prefix + sid,
            calls=self.calls_prefix + sid,
            deadlines=self.deadlines,
            record=_CALL_ENCODER.encode(call),
            engine=engine,
            deadline=self._deadline(),
            **self._prefixes,
        ).decode()

    def close(self, sid: str, result: dict[str, Any]) -> list[str]:
        now = time.time()
        raw = self.buf.call(
            CLOSE,
            session=self.session_prefix + sid,
            deadlines=self.deadlines,
            result=json.dumps(result),
            now=now,
            deadline=self._deadline(),
            lease=self.new_lease(now),
            **self._prefixes,
        )
        return [x.decode() for x in raw]

    def group(self, gid: str) -> tuple[dict[str, str], list[ClosedSession]]:
        """A complete group's meta and its closed sessions (two round trips)."""
        meta, sids = self.buf.pipeline(
            lambda p: [p.hgetall(self.group_prefix + gid), p.lrange(self.members_prefix + gid, 0, -1)]
        )

        def fill(pipe) -> None:
            for sid in sids:
                pipe.hgetall(self.session_prefix + sid.decode())
                pipe.lrange(self.calls_prefix + sid.decode(), 0, -1)

        replies = self.buf.pipeline(fill)
        sessions = []
        for info, calls in zip(replies[::2], replies[1::2]):
            info = {k.decode(): v.decode() for k, v in info.items()}
            if info.get("state") != "closed":
                raise ValueError(f"group {gid}: session {info.get('index')} is {info.get('state') or 'gone'}")
            sessions.append(
                ClosedSession(
                    index=int(info["index"]),
                    calls=[_CALL_DECODER.decode(c) for c in calls],
                    result=json.loads(info["result"]),
                    closed_at=float(info["closed_at"]),
                )
            )
        return {k.decode(): v.decode() for k, v in meta.items()}, sessions

    def finish(self, gid: str) -> None:
        self.buf.call(
            FINISH,
            group=self.group_prefix + gid,
            members=self.members_prefix + gid,
            deadlines=self.deadlines,
            gid=gid,
            **self._prefixes,
        )

    def claim(self, count: int) -> tuple[list[tuple[str, str]], int]:
        """Up to `count` groups past their deadline, leased to the caller: [(gid, state)], lease."""
        now = time.time()
        lease = self.new_lease(now)
        raw = self.buf.call(
            CLAIM,
            deadlines=self.deadlines,
            group_prefix=self.group_prefix,
            now=int(now * 1000),
            lease=lease,
            count=count,
        )
        return [(raw[i].decode(), raw[i + 1].decode()) for i in range(0, len(raw), 2)], lease

    def drop(self, gid: str, lease: int) -> tuple[int, int] | None:
        """Expire a group leased to us: (sessions opened, closed), or None when it is not ours."""
        raw = self.buf.call(
            DROP,
            group=self.group_prefix + gid,
            members=self.members_prefix + gid,
            deadlines=self.deadlines,
            running=self.keys.running,
            gid=gid,
            lease=lease,
            **self._prefixes,
        )
        return (int(raw[0]), int(raw[1])) if raw else None

    def abandon(self, sid: str) -> list[str]:
        """Fail `sid`'s whole group now (ABANDON's answer, decoded)."""
        raw = self.buf.call(
            ABANDON,
            session=self.session_prefix + sid,
            deadlines=self.deadlines,
            running=self.keys.running,
            now=time.time(),
            **self._prefixes,
        )
        return [x.decode() if isinstance(x, bytes) else str(x) for x in raw]

    def lease(self, gid: str, lease: int) -> None:
        self.buf.redis.zadd(self.deadlines, {gid: lease}, xx=True)
