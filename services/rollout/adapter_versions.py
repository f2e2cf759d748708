"""Which LoRA adapters of the run each engine holds, which of them this replica's requests and
evaluations use, and when one may go (docs/architecture.md §5, "LoRA versions"). The weight
follower (`engine_updates.WeightSync`) drives it under its lock; generation asks it which
adapter to name.

A `[trainer.lora]` run publishes each version as a PEFT adapter directory announced with its
`adapter_name` (services/transport/weights). The engines keep the base model they started with
and hold a few adapters beside it; a request names one (`lora_path`), and the engine's
`weight_version` stays the base's, so a token's version is the version of the adapter its
request named.

Guarantees:
* `lease` names the newest adapter held by every admin engine behind a generation endpoint, or
  none at all: the caller never falls back to the base model for the policy.
* An adapter a lease (a request in flight) or a pin (an evaluation) uses is never unloaded by
  this replica, and neither is the newest one on an engine. Past `max_loaded` on an engine the
  oldest others are unloaded (`trim`), before a load (so the engine's own bound,
  `max_loaded_loras`, never has to evict) and after a lease or pin ends.
* The engine's word wins: a load's answer lists every adapter the engine holds, and this
  replica's record of that engine becomes the run's adapters in that list. One the engine lost
  (a restart, its own eviction) is forgotten; one an earlier rollout process loaded is adopted,
  and unloaded in its turn.

Limits: leases and pins are this replica's. Another rollout replica driving the same engines
may unload an adapter this one still uses (after its requests end: an engine answers an unload
once the adapter's requests are done); this one's next request naming it is refused with
"not loaded", and the caller reloads it (`WeightSync.recover`) and tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from asyncrl.proto import WeightsInfo
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import EngineClient, EngineEndpoint, EngineFailure
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.transport.weights import parse_adapter_name

log = logging.getLogger(__name__)


class NoAdapter(EngineFailure):
    """No adapter of the run is held by the engines behind an endpoint: it samples nothing for
    the policy (the group goes on on an engine that holds one)."""


class Rids(set):
    """The engine rids of one request while it runs, mirrored into its caller's set (which a
    cancel aborts): the ones to abort when a newer adapter arrives."""

    def __init__(self, mirror: set[str]):
        super().__init__()
        self.mirror = mirror

    def add(self, rid: str) -> None:
        super().add(rid)
        self.mirror.add(rid)

    def discard(self, rid: str) -> None:
        super().discard(rid)
        self.mirror.discard(rid)


@dataclass(eq=False)
class Lease:
    """One request's use of an adapter, from just before it is sent until it is answered."""

    engine: EngineEndpoint  # where the request goes
    admins: tuple[int, ...]  # the admin engines behind it (each holds the adapter)
    name: str
    version: int
    epoch: int
    rids: Rids


class AdapterVersions:
    def __init__(self, engines: EngineClient, *, run: str, max_loaded: int):
        self.engines, self.run, self.max_loaded = engines, run, max_loaded
        self.loaded: defaultdict[int, set[str]] = defaultdict(set)  # admin index -> adapters it holds
        self.unloading: defaultdict[int, set[str]] = defaultdict(set)  # ... being unloaded by this replica
        self.order: dict[str, tuple[int, int]] = {}  # adapter name -> (epoch, version)
        self.infos: dict[str, WeightsInfo] = {}  # adapter name -> its announcement (reloads)
        self.leases: set[Lease] = set()
        self.pins: Counter[tuple[int, str]] = Counter()  # (admin index, adapter) -> evaluations
        self._trims: set[asyncio.Task] = set()

    def announced(self, info: WeightsInfo) -> None:
        """`info` (kind "lora") was announced: its adapter may be loaded from its path."""
        assert info.adapter_name is not None and info.path is not None  # (WeightsInfo checks kind="lora")
        self.order[info.adapter_name] = (info.epoch, info.version)
        self.infos[info.adapter_name] = info

    # --- what the engines hold --------------------------------------------------------------

    def held(self, admins: Iterable[int]) -> set[str]:
        """The adapters every one of `admins` holds (none when `admins` is empty)."""
        sets = [self.loaded[i] for i in admins]
        return set.intersection(*sets) if sets else set()

    def newest(self, names: Iterable[str]) -> str | None:
        return max(names, key=self.order.__getitem__, default=None)

    def newest_on(self, admins: Iterable[int]) -> str | None:
        return self.newest(self.held(admins))

    def holding(self, admins: Iterable[int], version: int) -> str | None:
        """The newest adapter of policy version `version` (any epoch) that `admins` all hold."""
        return self.newest(n for n in self.held(admins) if self.order[n][1] == version)

    def _record(self, i: int, listed: dict[str, str] | None, loading: str) -> None:
        """What engine `i` says it holds is what it holds (the run's adapters in `listed`, the
        answer to the load of `loading`)."""
        if listed is None:
            return
        ours = {}
        for name in listed:
            parsed = parse_adapter_name(self.run, name)
            if parsed is not None:
                ours[name] = (parsed[1], parsed[0])
        for name, at in ours.items():
            self.order.setdefault(name, at)
        lost = self.loaded[i] - set(ours)
        adopted = set(ours) - self.loaded[i] - self.unloading[i] - {loading}
        if lost or adopted:
            log_event(
                log,
                "engine's adapters differ from this replica's record: taking the engine's",
                logging.WARNING,
                engine=i,
                lost=sorted(lost),
                adopted=sorted(adopted),
            )
        self.loaded[i] = set(ours) - self.unloading[i]

    async def load(self, e: EngineEndpoint, name: str) -> str | None:
        """Load announced adapter `name` on admin engine `e` (room made first); None once `e`
        holds it, else the problem (counted: that version is not sampled on `e`)."""
        if name in self.loaded[e.index]:
            return None
        await self.trim(e, self.max_loaded - 1)
        path = self.infos[name].path
        answer = await self.engines.load_adapter(e, name, path)
        self._record(e.index, answer.loaded, loading=name)
        # "already loaded" (an earlier process of this rollout loaded it): held, if from our path
        if answer.ok or (answer.loaded or {}).get(name) == path:
            self.loaded[e.index].add(name)
            m.ADAPTER_LOADS.inc()
            await self.trim(e, self.max_loaded)
            return None
        m.ADAPTER_LOAD_FAILURES.labels(e.label).inc()
        return f"{e.url}: {answer.message or 'load_lora_adapter failed'}"

    def forget(self, admins: Iterable[int], name: str) -> None:
        """The engines `admins` said they do not hold `name`."""
        for i in admins:
            self.loaded[i].discard(name)

    def retire(self, i: int) -> None:
        """Admin `i` left: nothing of it is kept (its index is never reused)."""
        self.loaded.pop(i, None)
        self.unloading.pop(i, None)

    # --- uses -------------------------------------------------------------------------------

    def lease(self, engine: EngineEndpoint, admins: tuple[int, ...], mirror: set[str]) -> Lease | None:
        """The newest adapter every one of `admins` holds, marked in use until `release`; None
        when they hold none."""
        name = self.newest_on(admins)
        if name is None:
            return None
        epoch, version = self.order[name]
        lease = Lease(engine, admins, name, version, epoch, Rids(mirror))
        self.leases.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        self.leases.discard(lease)

    def outdated(self) -> list[Lease]:
        """Leases whose admins all hold a newer adapter than the one their request names."""
        return [
            lease
            for lease in self.leases
            if self.order[self.newest_on(lease.admins) or lease.name] > self.order[lease.name]
        ]

    def pin(self, admins: tuple[int, ...], name: str) -> None:
        for i in admins:
            self.pins[(i, name)] += 1

    def unpin(self, admins: tuple[int, ...], name: str) -> None:
        for i in admins:
            self.pins[(i, name)] -= 1
            if self.pins[(i, name)] <= 0:
                del self.pins[(i, name)]

    def in_use(self, i: int) -> set[str]:
        used = {lease.name for lease in self.leases if i in lease.admins}
        return used | {name for (j, name) in self.pins if j == i}

    # --- unloading --------------------------------------------------------------------------

    async def trim(self, e: EngineEndpoint, limit: int) -> None:
        """Unload the oldest adapters of admin engine `e` beyond `limit`, skipping the newest
        and any in use. The victims are out of the record before any await, so no lease or pin
        can take one meanwhile."""
        i = e.index
        held, newest, used = self.loaded[i], self.newest_on((i,)), self.in_use(e.index)
        spare = sorted((n for n in held if n != newest and n not in used), key=self.order.__getitem__)
        victims = spare[: max(len(held) - limit, 0)]
        if not victims:
            return
        held.difference_update(victims)
        self.unloading[i].update(victims)
        answers = await asyncio.gather(*(self.engines.unload_adapter(e, n) for n in victims))
        for name, answer in zip(victims, answers):
            self.unloading[i].discard(name)
            m.ADAPTER_UNLOADS.labels("ok" if answer.ok else "error").inc()
            if not answer.ok:  # (the next load's answer says whether the engine still holds it)
                log_event(log, "adapter unload failed", logging.WARNING, adapter=name, error=answer.message)

    def trim_later(self, admins: Iterable[int]) -> None:
        """`trim` the admins in `admins` to `max_loaded`, in the background (after a use ended)."""
        by_index = {a.index: a for a in self.engines.admins}
        for i in admins:
            if i in by_index and len(self.loaded[i]) > self.max_loaded:
                task = asyncio.ensure_future(self.trim(by_index[i], self.max_loaded))
                self._trims.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._trims.discard)

    def cancel(self) -> None:
        for task in self._trims:
            task.cancel()
