"""Sessions recorded first and grouped after (the gateway's verifiers runs,
services/rollout/gateway/vf_runs.py): each rollout's session waits in a holding group of its
own, named after the session, of size 0 (so closing it never completes a group); `GATHER`
moves the finished sessions of one group into a new open group of their number, which the
gateway then closes session by session and puts like any other (buffer/sessions.py).

Keys are buffer/sessions.py's; nothing here reads or writes another key.
"""

from __future__ import annotations

import time

from asyncrl.buffer.connection import Script
from asyncrl.buffer.sessions import _TOUCH, KEY_TTL_FACTOR, SessionStore

HOLDING_SIZE = 0  # a holding group's size: no close completes it, only `GATHER` empties it

# Move `sids` (each open in its holding group, with calls) into the new group `gid`, in order;
# their holding groups are deleted. {'ok'}; {'exists', state} when `gid` exists (a retry);
# {'unknown' | 'taken' | 'empty', sid} for the first session that cannot join (nothing moved).
GATHER = Script(
    "group members deadlines",
    "group_prefix members_prefix session_prefix calls_prefix ttl_ms gid prompt_id submit_version now deadline *sids",
    _TOUCH
    + """
local state = redis.call('HGET', group, 'state')
if state then return {'exists', state} end
for _, sid in ipairs(sids) do
  local s = redis.call('HMGET', session_prefix .. sid, 'state', 'group_id', 'calls')
  if not s[1] then return {'unknown', sid} end
  if s[1] ~= 'open' or s[2] ~= sid then return {'taken', sid} end
  if tonumber(s[3]) == 0 then return {'empty', sid} end
end
redis.call('HSET', group, 'state', 'open', 'size', #sids, 'prompt_id', prompt_id ~= '' and prompt_id or gid,
           'spec', '', 'submit_version', submit_version, 'created_at', now, 'opened', #sids, 'closed', 0)
for i, sid in ipairs(sids) do
  redis.call('HSET', session_prefix .. sid, 'group_id', gid, 'index', i - 1)
  redis.call('RPUSH', members, sid)
  redis.call('DEL', group_prefix .. sid, members_prefix .. sid)
  redis.call('ZREM', deadlines, sid)
end
touch(gid)
redis.call('ZADD', deadlines, deadline, gid)
return {'ok'}
""",
)


def open_holding(store: SessionStore, sid: str) -> str:
    """Open `sid` in a holding group of its own (no admission slot: none is taken until the
    group is gathered); 'ok', or 'exists' when a concurrent first call opened it."""
    return store.open(sid, sid, HOLDING_SIZE, "", "", 0)[0]


def gather(
    store: SessionStore, gid: str, sids: list[str], submit_version: int, prompt_id: str = ""
) -> list[str]:
    """Run `GATHER` (see above) for `sids` into `gid`."""
    raw = store.buf.call(
        GATHER,
        group=store.group_prefix + gid,
        members=store.members_prefix + gid,
        deadlines=store.deadlines,
        group_prefix=store.group_prefix,
        members_prefix=store.members_prefix,
        session_prefix=store.session_prefix,
        calls_prefix=store.calls_prefix,
        ttl_ms=int(store.ttl_s * KEY_TTL_FACTOR * 1000),
        gid=gid,
        prompt_id=prompt_id,
        submit_version=submit_version,
        now=time.time(),
        deadline=int((time.time() + store.ttl_s) * 1000),
        sids=list(sids),
    )
    return [x.decode() for x in raw]


def drop_holding(store: SessionStore, sid: str) -> bool:
    """Delete `sid` and its calls if it still waits in its holding group (a failed group's
    rollout); False when there is nothing to drop."""
    info = store.session(sid)
    if info.get("group_id") != sid:
        return False
    lease = store.new_lease()
    store.lease(sid, lease)
    return store.drop(sid, lease) is not None
