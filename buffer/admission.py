"""Admission (docs/architecture.md §5): AReaL's rule, atomic across any number of rollout replicas.

A replica may start a group only while `accepted + running < (η + v + 1) · B`. `accepted` counts
the groups put and not given back (a group that leaves the buffer untrained gives its count
back: buffer/groups.py); `running` is the size of the `running` hash (group_id → admit time),
so a slot belongs to a group id and asking again for the same group takes none. B and η are
the trainer's, stored in `config`; until it has written them, a replica uses its own defaults.
"""

from __future__ import annotations

import time

from asyncrl.buffer import metrics as m
from asyncrl.buffer.connection import Buffer, Script
from asyncrl.proto.states import Admission

# One `Admission` value per group of `group_ids`, in order: `resumed` if the group holds a slot,
# `duplicate` if it was put, else `admitted` while the rule allows. The first `full` ends the
# call: the groups after it are answered `full` unasked, so admission stays first come, first
# served (a later group never takes the slot an earlier one waits for). One call for a whole
# queue of waiting groups is one round trip and, on a Redis that fsyncs every write, one fsync.
TRY_ADMIT = Script(
    "admission running version config state",
    "now default_eta default_batch_groups *group_ids",
    """
local accepted = tonumber(redis.call('HGET', admission, 'accepted') or '0')
local v = tonumber(redis.call('GET', version) or '0')
local eta = tonumber(redis.call('HGET', config, 'max_staleness') or default_eta)
local b = tonumber(redis.call('HGET', config, 'batch_groups') or default_batch_groups)
local used, out = accepted + redis.call('HLEN', running), {}
for i, group_id in ipairs(group_ids) do
  if redis.call('HEXISTS', running, group_id) == 1 then out[i] = 'resumed'
  elseif redis.call('HEXISTS', state, group_id) == 1 then out[i] = 'duplicate'
  elseif used < (eta + v + 1) * b then
    redis.call('HSET', running, group_id, now)
    used = used + 1
    out[i] = 'admitted'
  else
    for j = i, #group_ids do out[j] = 'full' end
    return out
  end
end
return out
""",
)

# After a trainer restart at `trained_version`: what it trained is v·B groups; what is still in
# the groups stream (undelivered or pending) is accepted but untrained.
REBUILD = Script(
    "admission groups version config",
    "trained_version default_batch_groups",
    """
local b = tonumber(redis.call('HGET', config, 'batch_groups') or default_batch_groups)
local accepted = tonumber(trained_version) * b + redis.call('XLEN', groups)
redis.call('HSET', admission, 'accepted', accepted)
redis.call('SET', version, trained_version)
return accepted
""",
)


class AdmissionControl:
    """`batch_groups` and `max_staleness` apply until the trainer has `configure`d the run."""

    def __init__(self, buf: Buffer, batch_groups: int = 1, max_staleness: int = 0):
        self.buf, self.keys = buf, buf.keys
        self.batch_groups, self.max_staleness = batch_groups, max_staleness

    def configure(self, batch_groups: int, max_staleness: int) -> None:
        """Store B and η run-wide so every admitting replica applies the same rule."""
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError("batch_groups must be >= 1 and max_staleness >= 0")
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.buf.redis.hset(
            self.keys.config, mapping={"batch_groups": batch_groups, "max_staleness": max_staleness}
        )

    def try_admit(self, group_id: str) -> Admission:
        """Take a slot for `group_id` if the rule allows (or say why not)."""
        return self.try_admit_many([group_id])[0]

    def try_admit_many(self, group_ids: list[str]) -> list[Admission]:
        """`try_admit` for a queue of groups in one round trip, first come first served: the
        first `full` answers every group after it `full` too."""
        if not group_ids:
            return []
        k = self.keys
        raw = self.buf.call(
            TRY_ADMIT,
            admission=k.admission,
            running=k.running,
            version=k.version,
            config=k.config,
            state=k.group_state,
            now=time.time(),
            default_eta=self.max_staleness,
            default_batch_groups=self.batch_groups,
            group_ids=list(group_ids),
        )
        results = [Admission(r.decode()) for r in raw]
        for r in results:  # the groups behind the first `full` were not asked: not counted
            m.ADMISSION.labels(r.value).inc()
            if r is Admission.full:
                break
        return results

    def release(self, group_id: str) -> bool:
        """Give back the slot of a group that will not be put (failed or cancelled)."""
        return bool(self.buf.redis.hdel(self.keys.running, group_id))

    def rebuild(self, version: int) -> int:
        """After a trainer restart: accepted := version·B + groups still in the buffer; sets v."""
        k = self.keys
        return int(
            self.buf.call(
                REBUILD,
                admission=k.admission,
                groups=k.groups,
                version=k.version,
                config=k.config,
                trained_version=int(version),
                default_batch_groups=self.batch_groups,
            )
        )

    def snapshot(self) -> dict[str, int]:
        """The rule's numbers now: accepted, running, version, B, η and the capacity they give."""
        k = self.keys
        pipe = self.buf.redis.pipeline(transaction=False)
        accepted, running, version, cfg = (
            pipe.hget(k.admission, "accepted").hlen(k.running).get(k.version).hgetall(k.config).execute()
        )
        b = int(cfg.get(b"batch_groups", self.batch_groups))
        eta = int(cfg.get(b"max_staleness", self.max_staleness))
        v = int(version or 0)
        return {
            "accepted": int(accepted or 0),
            "running": running,
            "version": v,
            "batch_groups": b,
            "max_staleness": eta,
            "capacity": (eta + v + 1) * b,
        }
