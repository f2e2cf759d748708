"""Weight updates (DESIGN.md §5): follow the run's `weights` channel and move the engines to
each new policy version.

* `disk` events: this service drives the engines with one `/update_weights_from_disk` each
  (`weight_version` = the policy version, `abort_all_requests`, `flush_cache`): in-flight
  requests return at once with `finish_reason: abort` and their partial tokens, and the
  safetensors directory is loaded; then `/continue_generation`. While an update runs,
  `ready` is clear and no `/generate` is sent, so the resubmitted remainders (prompt +
  tokens so far) run on the new weights and their tokens carry the new version. No KV from
  old weights is reused: the engine flushes its cache and the remainder is prefilled from
  scratch.
* `distributed` events: the trainer broadcasts to the engines itself; this service only
  records the version. Any request the trainer's update aborts comes back with
  `finish_reason: abort` and is resubmitted like any other.

Versions only move forward; a missed pub/sub message is caught up by polling the latest
weights every `poll_s`, and at start the engines are brought to the latest disk weights.
"""

from __future__ import annotations

import asyncio
import logging
import time

from buffer import ReplayBuffer
from proto import WeightsInfo
from services.common.logging import log_event
from services.rollout import metrics as m
from services.rollout.engine_client import EngineClient

log = logging.getLogger(__name__)

SUBSCRIPTION_WAIT_S = 1.0  # one blocking pub/sub read; bounds how long shutdown waits


class WeightSync:
    def __init__(self, buf: ReplayBuffer, engines: EngineClient, *, poll_s: float):
        self.buf = buf  # this component's own instance: used from one worker thread at a time
        self.engines = engines
        self.poll_s = poll_s
        self.version = -1  # last version the engines were moved to (-1: not known yet)
        self.ready = asyncio.Event()
        self.ready.set()
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Forever: catch up with the latest weights, then apply each announced version."""
        await self._catch_up(initial=True)
        sub = await asyncio.to_thread(self.buf.subscribe_weights)
        next_poll = time.monotonic() + self.poll_s
        try:
            while True:
                info = await asyncio.to_thread(sub.get, SUBSCRIPTION_WAIT_S)
                if info is not None:
                    await self.apply(info)
                if time.monotonic() >= next_poll:
                    await self._catch_up()
                    next_poll = time.monotonic() + self.poll_s
        finally:
            await asyncio.to_thread(sub.close)

    async def _catch_up(self, initial: bool = False) -> None:
        latest = await asyncio.to_thread(self.buf.latest_weights)
        if latest is None or latest.version <= self.version:
            return
        if initial and latest.method == "disk":
            current = await self.engines.weight_versions()
            if current and all(v == str(latest.version) for v in current):
                self.version = latest.version  # the engines already serve it (e.g. a rollout restart)
                m.POLICY_VERSION.set(latest.version)
                return
        await self.apply(latest)

    async def apply(self, info: WeightsInfo) -> bool:
        async with self._lock:
            if info.version <= self.version:
                return True
            if info.method == "distributed":
                self.version = info.version
                m.POLICY_VERSION.set(info.version)
                m.WEIGHT_UPDATES.labels("distributed", "observed").inc()
                return True
            t0 = time.perf_counter()
            self.ready.clear()
            try:
                errors = await self.engines.update_all_from_disk(info.path or "", info.version)
            finally:
                self.ready.set()
            m.WEIGHT_UPDATE_SECONDS.observe(time.perf_counter() - t0)
            if errors:
                # The engines that failed keep serving (and reporting) their old version, so
                # token versions stay truthful; the next event or poll tries again.
                m.WEIGHT_UPDATES.labels("disk", "error").inc()
                log_event(log, "weight update failed", logging.ERROR, version=info.version, errors=errors)
                return False
            self.version = info.version
            m.POLICY_VERSION.set(info.version)
            m.WEIGHT_UPDATES.labels("disk", "ok").inc()
            log_event(
                log,
                "engines updated",
                version=info.version,
                path=info.path,
                seconds=round(time.perf_counter() - t0, 3),
            )
            return True
