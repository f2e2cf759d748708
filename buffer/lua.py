"""Lua scripts: every multi-key update of the buffer is one atomic script (docs/architecture.md §4).

Per-group state lives in the `index` hash: group_id → stream entry id while the group is
in the buffer, then `acked`, `dropped`, `withheld`, `zero_spread`, … once it has left it.
Every transition is taken at most once, so counters stay exact under redelivery.
The admission rule is AReaL's: a replica may start a group only while
`accepted + running < (η + v + 1) · B`; `running` is the size of the `running` hash
(group_id → admit time), which makes admission idempotent per group.
"""

# Scripts that handle many groups per call make one command per kind of update, not one per
# group: a `redis.call` costs ~3.5 µs here, which per group cost more than the rest of the put.
# Lua's `unpack` is bounded by its C stack, so long lists go in slices (`sliced`).
# `sliced(items, cmd, ...)` calls `cmd ... items[s..s+999]` for each slice and joins the replies.
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

# KEYS: index, groups, admission, stats, running, gjob, payload_1 .. payload_n
# ARGV: n, then per group: group_id, job_id, min_version
# Returns one flag per group: 1 new, 0 seen before (idempotent on group_id; a group_id twice in
# one call is put once).
# The payloads were written by `SET payload NX` in the same pipeline: passing ~200 kB through a
# Lua argument costs as much as the XADD itself, so the stream entry holds the id (and the oldest
# token version, for inspection).
PUT_GROUPS = _SLICED + """
local n = tonumber(ARGV[1])
local gids = {}
for i = 1, n do gids[i] = ARGV[3 * i - 1] end
sliced(gids, 'HDEL', KEYS[5])
local states = sliced(gids, 'HMGET', KEYS[1])
local out, seen, index, jobs, new = {}, {}, {}, {}, 0
for i = 1, n do
  local gid = gids[i]
  if states[i] or seen[gid] then
    -- a group that has left the buffer: its payload was just written again by SET NX
    if states[i] and not string.find(states[i], '^%d+%-%d+$') then redis.call('DEL', KEYS[6 + i]) end
    out[i] = 0
  else
    seen[gid] = true
    local eid = redis.call('XADD', KEYS[2], '*', 'gid', gid, 'mv', ARGV[3 * i + 1])
    index[#index + 1], index[#index + 2] = gid, eid
    jobs[#jobs + 1], jobs[#jobs + 2] = gid, ARGV[3 * i]
    new = new + 1
    out[i] = 1
  end
end
if new > 0 then
  sliced(index, 'HSET', KEYS[1])
  sliced(jobs, 'HSET', KEYS[6])
  redis.call('HINCRBY', KEYS[3], 'accepted', new)
  redis.call('HINCRBY', KEYS[4], 'put', new)
end
if new < n then redis.call('HINCRBY', KEYS[4], 'duplicates', n - new) end
return out
"""

# KEYS: admission, running, version, config, index
# ARGV: group_id, now, default_eta, default_batch_groups
# Returns {code, accepted, running, capacity}; code 1 admitted, 2 already running, 3 already buffered, 0 full.
TRY_ADMIT = """
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0')
local running = redis.call('HLEN', KEYS[2])
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
local eta = tonumber(redis.call('HGET', KEYS[4], 'max_staleness') or ARGV[3])
local b = tonumber(redis.call('HGET', KEYS[4], 'batch_groups') or ARGV[4])
local capacity = (eta + v + 1) * b
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {2, accepted, running, capacity} end
if redis.call('HEXISTS', KEYS[5], ARGV[1]) == 1 then return {3, accepted, running, capacity} end
if accepted + running < capacity then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  return {1, accepted, running + 1, capacity}
end
return {0, accepted, running, capacity}
"""

# KEYS: index, groups, admission, stats, gjob, job_prefix, payload_prefix
# ARGV: consumer_group, reason, n, gid1, eid1, gid2, eid2, ...
# (job and payload keys are built from prefixes that carry the run's hash tag: same slot.)
# Leaves the buffer for good: XACK + XDEL; the state moves from entry id to `reason` once.
# reason 'acked' keeps the group counted in `accepted` (it was trained); any other reason gives its
# admission slot back (it will never be trained, so it must not hold capacity).
FINISH = _SLICED + """
local group, reason, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local gids = {}
for i = 1, n do gids[i] = ARGV[2 + 2 * i] end
local states, jobs_of = sliced(gids, 'HMGET', KEYS[1]), sliced(gids, 'HMGET', KEYS[5])
local changed, entries, payloads, moved, left, jobs, done = 0, {}, {}, {}, {}, {}, {}
for i = 1, n do
  local gid, eid, state = gids[i], ARGV[3 + 2 * i], states[i]
  if eid == '' and not done[gid] then eid = state end  -- (a repeat in one call: handled once)
  if eid and eid ~= '' and string.find(eid, '^%d+%-%d+$') then entries[#entries + 1] = eid end
  if state and string.find(state, '^%d+%-%d+$') and not done[gid] then
    done[gid] = true
    payloads[#payloads + 1] = KEYS[7] .. gid
    moved[#moved + 1], moved[#moved + 2] = gid, reason
    left[#left + 1] = gid
    local job = jobs_of[i]
    if job then jobs[job] = (jobs[job] or 0) + 1 end
    changed = changed + 1
  end
end
sliced(entries, 'XACK', KEYS[2], group)
sliced(entries, 'XDEL', KEYS[2])
sliced(payloads, 'UNLINK')  -- frees the payloads off the main thread where Redis judges it worth it
if changed > 0 then
  sliced(moved, 'HSET', KEYS[1])
  sliced(left, 'HDEL', KEYS[5])  -- the job of a group is needed only while it is in the buffer
  redis.call('HINCRBY', KEYS[4], reason, changed)
  if reason ~= 'acked' then redis.call('HINCRBY', KEYS[3], 'accepted', -changed) end
end
for job, count in pairs(jobs) do redis.call('HINCRBY', KEYS[6] .. job, reason, count) end
return changed
"""

# KEYS: stream, deadletter, stats, index, admission, payload_key (or the stream key when none)
# ARGV: consumer_group, entry_id, reason, payload, stream_name, group_id, maxlen, holds_admission
# The entry is pending (it was just delivered): an XACK that finds nothing to ack means this
# ran before (a call re-sent after a lost reply), and nothing is dead-lettered twice.
DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*',
  'stream', ARGV[5], 'entry', ARGV[2], 'gid', ARGV[6], 'reason', ARGV[3], 'data', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'deadletter', 1)
if ARGV[6] ~= '' and redis.call('HGET', KEYS[4], ARGV[6]) == ARGV[2] then
  redis.call('HSET', KEYS[4], ARGV[6], 'deadletter')
  if KEYS[6] ~= KEYS[1] then redis.call('DEL', KEYS[6]) end
  if ARGV[8] == '1' then redis.call('HINCRBY', KEYS[5], 'accepted', -1) end
end
return 1
"""

# KEYS: jobindex, jobs, stats
# ARGV: group_id, payload
ENQUEUE_JOB = """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state then return {0, state} end
local eid = redis.call('XADD', KEYS[2], '*', 'gid', ARGV[1], 'data', ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], eid)
redis.call('HINCRBY', KEYS[3], 'jobs_enqueued', 1)
return {1, eid}
"""

# KEYS: jobindex, jobs, stats
# ARGV: consumer_group, group_id, final_state
ACK_JOB = """
local state = redis.call('HGET', KEYS[1], ARGV[2])
if not state or not string.find(state, '^%d+%-%d+$') then return 0 end
redis.call('XACK', KEYS[2], ARGV[1], state)
redis.call('XDEL', KEYS[2], state)
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'jobs_' .. ARGV[3], 1)
return 1
"""

# KEYS: admission, groups, version, config
# ARGV: version, default_batch_groups
# After a trainer restart: everything trained up to `version` is v·B groups; what is still in the
# groups stream (undelivered or pending) is accepted but untrained.
REBUILD_ADMISSION = """
local b = tonumber(redis.call('HGET', KEYS[4], 'batch_groups') or ARGV[2])
local accepted = tonumber(ARGV[1]) * b + redis.call('XLEN', KEYS[2])
redis.call('HSET', KEYS[1], 'accepted', accepted)
redis.call('SET', KEYS[3], ARGV[1])
return accepted
"""

# KEYS: weights, latest, version
# ARGV: version, payload, channel, keep, rollback
# `latest` only moves forward, except on rollback (a trainer resumed from a checkpoint older
# than what it had published): then versions above this one are forgotten, their weights gone.
PUBLISH_WEIGHTS = """
local v = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local latest = tonumber(redis.call('HGET', KEYS[2], 'version') or '-1')
if v >= latest or ARGV[5] == '1' then
  redis.call('HSET', KEYS[2], 'version', ARGV[1], 'data', ARGV[2])
end
for _, key in ipairs(redis.call('HKEYS', KEYS[1])) do
  local kv = tonumber(key)
  if kv <= v - tonumber(ARGV[4]) or (ARGV[5] == '1' and kv > v) then redis.call('HDEL', KEYS[1], key) end
end
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
"""

# KEYS: epoch, forks
# ARGV: fork version
# A resumed trainer's new epoch and the version it forked from (proto/lineage.py).
BEGIN_EPOCH = """
local e = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], e, ARGV[1])
return e
"""
