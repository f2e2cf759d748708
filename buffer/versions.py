"""Policy versions, their announcements and the run's lineage (docs/architecture.md §5).

The trainer sets `version` (optimizer steps taken) and publishes where each version's weights
are: the `weights` hash (the newest WEIGHTS_KEEP versions), `weights:latest` and an event on
the `weights` channel. A trainer that resumes a run opens a new epoch (`begin_epoch`,
proto/lineage.py) and republishes its checkpoint's version with `rollback`. The rollout
follows the events (`subscribe`) and polls `latest`.
"""

from __future__ import annotations

import time
from typing import Self

from asyncrl.buffer import metrics as m
from asyncrl.buffer.connection import Buffer, Part, Script
from asyncrl.proto import RecordDecodeError, WeightsInfo, decode, encode
from asyncrl.proto.lineage import Lineage

WEIGHTS_KEEP = 16  # weight locations kept per run

# `latest` only moves forward, except on rollback (a trainer resumed from a checkpoint older than
# what it had published): then the versions above this one are forgotten with their weights.
PUBLISH = Script(
    "weights latest",
    "version data channel keep rollback",
    """
local v = tonumber(version)
redis.call('HSET', weights, version, data)
if v >= tonumber(redis.call('HGET', latest, 'version') or '-1') or rollback == '1' then
  redis.call('HSET', latest, 'version', version, 'data', data)
end
for _, key in ipairs(redis.call('HKEYS', weights)) do
  local kv = tonumber(key)
  if kv <= v - tonumber(keep) or (rollback == '1' and kv > v) then redis.call('HDEL', weights, key) end
end
redis.call('PUBLISH', channel, data)
return 1
""",
)

# A resumed trainer's new epoch and the version it forked from.
BEGIN_EPOCH = Script(
    "epoch forks",
    "fork_version",
    """
local e = redis.call('INCR', epoch)
redis.call('HSET', forks, e, fork_version)
return e
""",
)


class PolicyVersions:
    """The run's policy version, where each version's weights are announced
    (services/transport/weights), and its lineage: one record per run in the buffer."""

    def __init__(self, buf: Buffer):
        self.buf, self.keys = buf, buf.keys

    def set_version(self, version: int) -> None:
        self.buf.redis.set(self.keys.version, int(version))

    def version(self) -> int:
        return int(self.buf.redis.get(self.keys.version) or 0)

    def version_part(self) -> Part:
        """`version` as part of a larger pipeline (`Buffer.pipeline_parts`)."""
        return Part(lambda pipe: pipe.get(self.keys.version), lambda replies: int(replies[0] or 0))

    def publish(self, info: WeightsInfo, *, rollback: bool = False, set_version: bool = False) -> None:
        """Record and announce where version `info.version` is. `rollback=True` (a trainer resumed
        behind what it had published) makes it the latest and forgets every newer version.
        `set_version`: then set `version` to it too, in the same round trip (one fsync, not two)."""
        k = self.keys

        def fill(pipe) -> None:
            self.buf.call(
                PUBLISH,
                pipe,
                weights=k.weights,
                latest=k.latest_weights,
                version=info.version,
                data=encode(info),
                channel=k.weights_channel,
                keep=WEIGHTS_KEEP,
                rollback="1" if rollback else "0",
            )
            if set_version:
                pipe.set(k.version, int(info.version))

        self.buf.pipeline(fill)

    def latest(self) -> WeightsInfo | None:
        data = self.buf.redis.hget(self.keys.latest_weights, "data")
        return decode(data, WeightsInfo) if data else None

    def subscribe(self) -> VersionSubscription:
        return VersionSubscription(self.buf)

    def begin_epoch(self, fork_version: int) -> int:
        """A trainer resumed at `fork_version`: open a new epoch and return it. Versions of older
        epochs above `fork_version` are from now on a lost history."""
        return int(
            self.buf.call(
                BEGIN_EPOCH, epoch=self.keys.epoch, forks=self.keys.forks, fork_version=int(fork_version)
            )
        )

    def lineage(self) -> Lineage:
        return self.buf.pipeline_parts(self.lineage_part(), wait=False)[0]

    def lineage_part(self) -> Part:
        """`lineage` as part of a larger pipeline (`Buffer.pipeline_parts`, `Buffer.payload_get`)."""

        def finish(replies: list) -> Lineage:
            epoch, forks = replies
            return Lineage(int(epoch or 0), {int(e): int(v) for e, v in forks.items()})

        return Part(lambda pipe: pipe.get(self.keys.epoch).hgetall(self.keys.forks), finish)


class VersionSubscription:
    """Pub/sub on the run's `weights` channel; `get(timeout)` returns the next WeightsInfo."""

    def __init__(self, buf: Buffer):
        self._buf = buf
        self._pubsub = buf.redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(buf.keys.weights_channel)

    def get(self, timeout: float = 1.0) -> WeightsInfo | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._pubsub.get_message(timeout=left)
            if msg is None or msg.get("type") != "message":
                continue
            try:
                return decode(msg["data"], WeightsInfo)
            except RecordDecodeError:
                # The authoritative copy is the `weights` hash; a bad broadcast is only counted.
                m.DEAD_LETTERED.labels("weights").inc()
                self._buf.redis.hincrby(self._buf.keys.stats, "bad_weight_events", 1)
        return None

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
