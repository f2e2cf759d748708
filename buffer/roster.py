"""The run's engine fleet as the rollout replicas agree on it (docs/architecture.md §7): the
engines joined through the rollout's `POST /v1/engines`, each with the time it was added, in one
hash. It is the wanted membership, not the live one: an engine stays listed while it is down
(the replicas take it out of the router and bring it back when it answers), and leaves only
through `DELETE /v1/engines`. It lets a restarted replica, and every other replica, manage the
same engines."""

from __future__ import annotations

import time

from asyncrl.buffer.connection import Buffer


class EngineRoster:
    def __init__(self, buf: Buffer):
        self.buf, self.key = buf, buf.keys.engines

    def add(self, url: str) -> None:
        """List `url` (the first time it was added is kept)."""
        self.buf.redis.hsetnx(self.key, url, repr(time.time()))

    def remove(self, url: str) -> bool:
        """Unlist `url`; False if it was not listed."""
        return bool(self.buf.redis.hdel(self.key, url))

    def members(self) -> dict[str, float]:
        """Every listed engine URL and the time it was added."""
        return {url.decode(): float(added) for url, added in self.buf.redis.hgetall(self.key).items()}
