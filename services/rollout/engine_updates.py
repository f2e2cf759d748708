"""Weight updates (docs/architecture.md §5): follow the run's `weights` channel and move the engines to
each new policy version; hold back the engines an evaluation has pinned.

* `disk` events: this service drives the engines with one `/update_weights_from_disk` each
  (`weight_version` = the policy version, `abort_all_requests`, `flush_cache`): in-flight
  requests return at once with `finish_reason: abort` and their partial tokens, and the
  safetensors directory is loaded; then `/continue_generation`. While an update runs,
  `ready` is clear and no `/generate` is sent, so the resubmitted remainders (prompt +
  tokens so far) run on the new weights and their tokens carry the new version. No KV from
  old weights is reused: the engine flushes its cache and the remainder is prefilled from
  scratch.
  With `weight_update_in_flight` the update is pause (`retract`), load without abort,
  continue instead (`EngineClient.update_from_disk`): nothing is resubmitted, and each token's
  version comes from the engine's per-token `weight_versions` spans.
* `disk` events of `kind="lora"` (a `[trainer.lora]` run): no weight update. The adapter is
  loaded beside the base on every admin engine (`/load_lora_adapter`), nothing is paused, and
  from then on each request names the newest adapter its engine holds (`lease`), its tokens
  labelled with that adapter's version (services/rollout/adapter_versions.py says what is
  kept loaded and when one goes). With `weight_update_abort` this replica's requests that name
  an older adapter are aborted by rid and go on under the new one. An engine that cannot load it
  keeps its older adapters and gets no new group while another holds the newest; an engine that
  lost its adapters (restarted) has them loaded again when a request is refused for it (`recover`).
* `distributed` events: the trainer broadcasts to the engines itself; this service only
  records the version. Any request the trainer's update aborts comes back with
  `finish_reason: abort` and is resubmitted like any other.

Versions only move forward in publication order, `(epoch, version)` (proto/lineage.py): a
trainer resumed from a checkpoint announces its version in a new epoch, and the engines are
moved back to it at once (in-flight requests aborted; the buffer drops what the lost weights
sampled). A missed pub/sub message is caught up by polling the latest weights every
`poll_s`, and at start the engines are brought to the latest disk weights.

Pins (evaluations, `services/rollout/evaluations/evaluator.py`). With LoRA a pin holds an
adapter, not an engine's updates: it chooses an engine whose admins hold the version's adapter,
which is not unloaded until `unpin`. Otherwise `pin()` chooses an engine and, under the
same lock every update holds, counts a pin on the admin engines that serve it (the admin with
the same URL; every admin when generation goes through a router). An update skips pinned
engines (`deferred`, counted as `asyncrl_rollout_weight_updates_total{result="deferred"}`);
their training requests keep generating at the old version and their tokens say so. When the
last pin on an engine is released it is moved to the newest weights. Because the pin is taken
under the lock, no update can be half-way through a pinned engine, and none starts on it until
`unpin`. Limits: pins are this replica's; another rollout replica driving the same engines'
updates, or a `distributed` update (the trainer's broadcast), does not see them. Evaluations
check every item's version for that reason.

`listeners` are called under the lock with each version first moved to (including the one the
engines serve at start), so a listener can pin an engine at exactly that version.

The admin engines may change at run time (an engine fleet, services/rollout/fleet.py): an update
goes to the admins of that moment. `bring_up` makes an engine an admin under the same lock, after
loading the current disk weights on it and reading them back, so it never holds a version the
others have left; `retire` takes one out, after any update under way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asyncrl.buffer import PolicyVersions
from asyncrl.proto import WeightsInfo
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.adapter_versions import AdapterVersions, Lease, NoAdapter
from asyncrl.services.rollout.clients.engine import EngineClient, EngineEndpoint
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.transport.weights import parse_weight_version, weight_version_name

log = logging.getLogger(__name__)

SUBSCRIPTION_WAIT_S = 1.0  # one blocking pub/sub read; bounds how long shutdown waits
PIN_RETRY_S = 0.1  # wait between pin attempts while no engine can be pinned (no I/O: cheap)


def policy_version(weight_version: str | None, initial: int) -> int:
    """An engine's `weight_version` as a policy version (SGLang starts at "default")."""
    parsed = parse_weight_version(weight_version)
    return parsed[0] if parsed else initial


class VersionNotServed(Exception):
    """No engine serves the version an evaluation must run at."""


class JoinRefused(Exception):
    """An engine cannot join the admins: it cannot be brought to the weights they serve."""


@dataclass(eq=False)
class Pin:
    engine: EngineEndpoint  # the generation endpoint the evaluation sends to
    admins: tuple[int, ...]  # admin engines whose updates wait for `unpin`
    version: int | None  # what they serve as far as this replica knows (None: unknown or mixed)
    adapter: str | None = None  # LoRA: the adapter of `version` the evaluation names (held while pinned)


class WeightSync:
    def __init__(
        self,
        published: PolicyVersions,
        engines: EngineClient,
        *,
        poll_s: float,
        initial_version: int = 0,
        run: str = "default",
        max_loaded_adapters: int = 4,
    ):
        self.published = published  # where the trainer announces its weights
        self.engines = engines
        self.adapters = AdapterVersions(engines, run=run, max_loaded=max_loaded_adapters)  # LoRA versions
        engines.eligible = self._eligible
        self.poll_s = poll_s
        self.initial_version = initial_version
        self.version = -1  # last version the engines were moved to (-1: not known yet)
        self.epoch = 0  # ... and its epoch
        self.latest: WeightsInfo | None = None  # the disk weights (or LoRA adapter) of `version`
        self.method: str | None = None  # of the last weights applied: disk | distributed
        self.served: dict[int, int] = {}  # admin index -> version it serves, as far as we know
        self.deferred: set[int] = set()  # admins left behind `version` by a pin
        self.pins: dict[int, int] = {}  # admin index -> pins held
        self.listeners: list[Callable[[int], Awaitable[None]]] = []
        # Called as an update starts moving engines (`ready` is clear): the trainer set the
        # buffer's version before announcing it, so admission for it may be asked while the
        # engines load the weights; generation waits for `ready` (segments.py).
        self.moving: list[Callable[[], None]] = []
        self.ready = asyncio.Event()
        self.ready.set()
        self.caught_up = asyncio.Event()  # set once the engines were brought to the latest weights at start
        self._lock = asyncio.Lock()
        self._announced: tuple[int, int] = (-1, -1)  # (epoch, version) last told to listeners
        self._refreshes: set[asyncio.Task] = set()
        self._stopped = False

    async def run(self) -> None:
        """Forever: catch up with the latest weights, then apply each announced version."""
        try:
            await self._catch_up(initial=True)
            self.caught_up.set()
            sub = await asyncio.to_thread(self.published.subscribe)
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
        finally:
            self._stopped = True  # pins released from now on (shutdown) move nothing
            for task in self._refreshes:
                task.cancel()
            self.adapters.cancel()

    async def _catch_up(self, initial: bool = False) -> None:
        latest = await asyncio.to_thread(self.published.latest)
        if (initial or (latest is None and self._announced[1] < 0)) and await self._adopt_served(latest):
            return
        if latest is not None and self._newer(latest):
            await self.apply(latest)
        elif self.deferred:
            await self.refresh()  # a deferred update whose first attempt failed
        elif self.lora:
            await self._load_missing()
        elif self.method == "disk" and self.latest is not None:
            await self._reload_restarted()

    async def _reload_restarted(self) -> None:
        """An engine that restarted (`asyncrl up` restarts a crashed one) serves the weights it
        starts with, and no update may come to move it (a trainer waiting for fresh groups
        publishes nothing): move each unpinned engine that reports other weights than the newest
        back to them. One `get_model_info` per engine per poll."""
        at = (self.epoch, self.version)
        admins = self._indices()
        current = dict(zip(admins, await self.engines.weight_versions(only=admins)))
        async with self._lock:
            if (self.epoch, self.version) != at or self.latest is None:
                return  # an update ran meanwhile: what was read may be out of date
            name = weight_version_name(self.latest.version, self.latest.epoch)
            live = set(self._indices())  # (an engine may have left the fleet meanwhile)
            behind = [
                i
                for i, v in current.items()
                if i in live
                and v is not None
                and v != name
                and not self.pins.get(i)
                and i not in self.deferred
            ]
            if behind:
                log_event(
                    log,
                    "engines serve other weights than the newest (restarted?): reloading",
                    logging.WARNING,
                    version=self.latest.version,
                    engines=self._urls(behind),
                    served=[current[i] for i in behind],
                )
                await self._move(self.latest, behind)

    async def _adopt_served(self, latest: WeightsInfo | None) -> bool:
        """Read the versions the engines serve. True when there is nothing to apply: they serve
        `latest` already (e.g. a rollout restart), or nothing was published yet (the version
        they start with is announced once every engine that answers agrees on it)."""
        admins = self._indices()
        current = await self.engines.weight_versions(only=admins)
        self.served = {i: policy_version(v, self.initial_version) for i, v in zip(admins, current) if v}
        versions = set(self.served.values())
        if latest is None:
            start = versions.pop() if len(versions) == 1 else None
        elif (
            latest.method == "disk"
            and latest.kind == "full"
            and current
            and all(v == weight_version_name(latest.version, latest.epoch) for v in current)
        ):
            start = latest.version
        else:
            return False
        async with self._lock:
            if latest is not None:
                self.version, self.epoch, self.latest, self.method = (
                    latest.version,
                    latest.epoch,
                    latest,
                    latest.method,
                )
                m.POLICY_VERSION.set(latest.version)
            if start is not None:
                await self._announce(start)
        return True

    def _newer(self, info: WeightsInfo) -> bool:
        return (info.epoch, info.version) > (self.epoch, self.version)

    async def apply(self, info: WeightsInfo) -> bool:
        async with self._lock:
            if not self._newer(info):
                return True
            if info.epoch > self.epoch:
                m.WEIGHT_UPDATES.labels(info.method, "rollback").inc()
                log_event(
                    log,
                    "rollback to a resumed trainer's weights",
                    version=info.version,
                    epoch=info.epoch,
                    lost_from=self.version,
                )
            if info.method == "distributed":
                self.version, self.epoch, self.method = info.version, info.epoch, info.method
                self.served = dict.fromkeys(self._indices(), info.version)
                m.POLICY_VERSION.set(info.version)
                m.WEIGHT_UPDATES.labels("distributed", "observed").inc()
                await self._announce(info.version, info.epoch)
                return True
            if info.kind == "lora":
                return await self._apply_adapter(info)
            targets = [i for i in self._indices() if not self.pins.get(i)]
            if not await self._move(info, targets):
                return False
            self.version, self.epoch, self.latest, self.method = info.version, info.epoch, info, info.method
            held = [i for i in self._indices() if self.pins.get(i)]
            if held:
                self.deferred.update(held)
                m.WEIGHT_UPDATES.labels("disk", "deferred").inc(len(held))
                log_event(
                    log,
                    "weight update deferred by an evaluation",
                    version=info.version,
                    engines=self._urls(held),
                )
            if targets:
                await self._announce(info.version, info.epoch)
            return True

    # --- LoRA versions (services/rollout/adapter_versions.py) ----------------------------------

    @property
    def lora(self) -> bool:
        """The engines serve the policy as LoRA adapters: requests name one (`lease`)."""
        return self.latest is not None and self.latest.kind == "lora"

    async def _apply_adapter(self, info: WeightsInfo) -> bool:
        """Load a LoRA version on every admin engine (the lock is held). Nothing is paused: the
        base weights do not change, and a request holds the adapter it named to its end. An
        engine that fails keeps its older adapters (its tokens say so) and gets no new group
        while another holds this version; the poll loads it again. False when every engine
        failed (the next event or poll tries again)."""
        targets = self._indices()
        loaded = await self._load_adapter(info, targets)
        if targets and not loaded:
            return False
        self.version, self.epoch, self.latest, self.method = info.version, info.epoch, info, info.method
        if loaded:
            await self._announce(info.version, info.epoch)
        return True

    async def _load_adapter(self, info: WeightsInfo, targets: list[int]) -> list[int]:
        """Load `info`'s adapter on the admin engines `targets` (the lock is held); the ones
        that hold it now. With `weight_update_abort` the requests in flight that name an older
        adapter on engines that now hold this one are aborted: their remainders go again naming
        this one (partial rollouts, as a disk update's abort)."""
        if not targets:
            return []
        t0 = time.perf_counter()
        for hook in self.moving:
            hook()
        self.adapters.announced(info)
        admins = {a.index: a for a in self.engines.admins}
        targets = [i for i in targets if i in admins]
        problems = await asyncio.gather(*(self.adapters.load(admins[i], info.adapter_name) for i in targets))
        loaded = [i for i, problem in zip(targets, problems) if problem is None]
        errors = [problem for problem in problems if problem is not None]
        m.WEIGHT_UPDATE_SECONDS.observe(time.perf_counter() - t0)
        for i in loaded:  # (the newest it holds: `info` may be an older one an evaluation needs again)
            self.served[i] = self.adapters.order[self.adapters.newest_on((i,)) or info.adapter_name][1]
        if errors:
            m.WEIGHT_UPDATES.labels("disk", "error").inc()
            log_event(
                log,
                "adapter load failed: this version is not sampled there until a retry loads it",
                logging.ERROR,
                version=info.version,
                adapter=info.adapter_name,
                errors=errors,
            )
        if loaded:
            m.POLICY_VERSION.set(info.version)
            m.WEIGHT_UPDATES.labels("disk", "ok").inc()
            log_event(
                log,
                "adapter loaded",
                version=info.version,
                adapter=info.adapter_name,
                engines=len(loaded),
                seconds=round(time.perf_counter() - t0, 3),
            )
        if self.engines.update_abort and not self.engines.update_in_flight:
            aborts = [(lease.engine, rid) for lease in self.adapters.outdated() for rid in list(lease.rids)]
            await asyncio.gather(*(self.engines.abort(e, rid) for e, rid in aborts))
        return loaded

    async def _load_missing(self) -> None:
        """Load the newest adapter on the admin engines that lack it (its load failed, the
        engine restarted, or it joined at run time): one poll's retry."""
        async with self._lock:
            info = self.latest
            if info is None or info.kind != "lora":
                return
            behind = [i for i in self._indices() if info.adapter_name not in self.adapters.loaded[i]]
            if behind:
                await self._load_adapter(info, behind)

    def _eligible(self, healthy: list[EngineEndpoint]) -> list[EngineEndpoint]:
        """The engines a new group may go to (`EngineClient.pick`): with LoRA, those whose admins
        hold the newest adapter, else (none does) those holding any adapter of the run; never
        one that would serve the base model in the policy's place."""
        if not self.lora or self.latest is None:
            return healthy
        holding = [(e, self.adapters.held(self._admins_of(e))) for e in healthy]
        current = [e for e, names in holding if self.latest.adapter_name in names]
        return current or [e for e, names in holding if names]

    def lease(self, engine: EngineEndpoint, rids: set[str]) -> Lease | None:
        """With LoRA, the adapter a request to `engine` names (the newest its admins hold), in
        use until `release`; None without LoRA (the engine's own weights). Raises `NoAdapter`
        when the engine holds none of the run's."""
        if not self.lora:
            return None
        lease = self.adapters.lease(engine, self._admins_of(engine), rids)
        if lease is None:
            raise NoAdapter(f"{engine.url} holds no LoRA adapter of this run (its loads failed)")
        return lease

    def release(self, lease: Lease) -> None:
        self.adapters.release(lease)
        self.adapters.trim_later(lease.admins)

    async def recover(self, engine: EngineEndpoint, name: str) -> None:
        """An engine behind `engine` refused adapter `name` as not loaded, although this replica
        had it there (the engine restarted, or evicted it): forget it there, and load the newest
        adapter again, and `name` too while an evaluation holds it. Counted; the caller sends
        its request again."""
        m.ADAPTER_LOST.inc()
        admins = self._admins_of(engine)
        log_event(log, "engine lost an adapter: reloading", logging.WARNING, engine=engine.url, adapter=name)
        async with self._lock:
            self.adapters.forget(admins, name)
            wanted = [self.latest] if self.latest is not None and self.latest.kind == "lora" else []
            pinned = any(self.adapters.pins.get((i, name)) for i in admins)
            if pinned and name in self.adapters.infos and (not wanted or wanted[0].adapter_name != name):
                wanted.append(self.adapters.infos[name])
            for info in wanted:
                await self._load_adapter(
                    info, [i for i in admins if info.adapter_name not in self.adapters.loaded[i]]
                )

    async def refresh(self) -> None:
        """Move the deferred engines no pin holds any more to the newest weights."""
        async with self._lock:
            due = sorted(i for i in self.deferred if not self.pins.get(i))
            if due and self.latest is not None and await self._move(self.latest, due):
                await self._announce(self.latest.version, self.latest.epoch)

    async def _move(self, info: WeightsInfo, targets: list[int]) -> bool:
        """Update the admin engines `targets` (the lock is held); False if any failed."""
        if not targets:
            return True
        t0 = time.perf_counter()
        self.ready.clear()
        for hook in self.moving:
            hook()
        try:
            name = weight_version_name(info.version, info.epoch)
            errors = await self.engines.update_all_from_disk(info.path or "", name, only=targets)
        finally:
            self.ready.set()
        m.WEIGHT_UPDATE_SECONDS.observe(time.perf_counter() - t0)
        if errors:
            # The engines that failed keep serving (and reporting) their old version, so
            # token versions stay truthful; the next event or poll tries again.
            m.WEIGHT_UPDATES.labels("disk", "error").inc()
            log_event(log, "weight update failed", logging.ERROR, version=info.version, errors=errors)
            return False
        for i in targets:
            self.served[i] = info.version
            self.deferred.discard(i)
        m.POLICY_VERSION.set(info.version)
        m.WEIGHT_UPDATES.labels("disk", "ok").inc()
        log_event(
            log,
            "engines updated",
            version=info.version,
            path=info.path,
            engines=len(targets),
            seconds=round(time.perf_counter() - t0, 3),
        )
        return True

    async def _announce(self, version: int, epoch: int | None = None) -> None:
        at = (self.epoch if epoch is None else epoch, version)
        if at <= self._announced:
            return
        self._announced = at
        for listener in self.listeners:
            await listener(version)

    # --- pins (evaluations) -------------------------------------------------------------------

    async def pin(self, version: int | None = None) -> Pin:
        """Hold the weights of one engine: the least loaded healthy one serving the newest
        version this replica knows, or exactly `version` (raises `VersionNotServed` when no
        engine does). Waits while no suitable engine is healthy, and (without `version`) while
        the only ones left are about to be moved after an earlier pin: back-to-back evaluations
        do not keep an engine on old weights."""
        while True:
            async with self._lock:
                pin = self.pin_locked(version)
            if pin is not None:
                return pin
            await asyncio.sleep(PIN_RETRY_S)

    def pin_locked(self, version: int | None = None) -> Pin | None:
        """`pin` for a caller that holds the lock (a listener); None when `pin` must wait."""
        assert self._lock.locked(), "a pin is taken under the weight-update lock"
        if self.lora:
            return self._pin_adapter(version)
        candidates = []
        for e in self.engines.engines:
            admins = self._admins_of(e)
            served = {self.served.get(i) for i in admins}
            candidates.append((e, admins, served.pop() if len(served) == 1 else None))
        if version is not None:
            candidates = [c for c in candidates if c[2] == version]
            if not candidates:
                raise VersionNotServed(
                    f"no engine serves version {version} any more (engines at "
                    f"{sorted(set(self.served.values()))})"
                )
        elif self._refreshes:  # an engine a pin held back is about to move: wait for it
            candidates = [c for c in candidates if not self.deferred.intersection(c[1])]
        candidates = [c for c in candidates if c[0].healthy]
        newest = max((c[2] for c in candidates if c[2] is not None), default=None)
        candidates = [c for c in candidates if c[2] == newest] or candidates
        if not candidates:
            return None
        engine, admins, served_version = min(candidates, key=lambda c: c[0].in_flight)
        for i in admins:
            self.pins[i] = self.pins.get(i, 0) + 1
        return Pin(engine, admins, served_version)

    def _pin_adapter(self, version: int | None) -> Pin | None:
        """`pin_locked` with LoRA: an engine whose admins all hold the adapter of `version` (the
        newest one, without `version`), which then stays loaded until `unpin`. Updates go on:
        a newer adapter does not change what the evaluation's requests name."""
        candidates = []
        for e in self.engines.engines:
            admins = self._admins_of(e)
            name = (
                self.adapters.newest_on(admins) if version is None else self.adapters.holding(admins, version)
            )
            if name is not None:
                candidates.append((e, admins, name))
        if version is not None and not candidates:
            raise VersionNotServed(f"no engine holds the LoRA adapter of version {version} any more")
        candidates = [c for c in candidates if c[0].healthy]
        newest = self.adapters.newest(c[2] for c in candidates)
        candidates = [c for c in candidates if c[2] == newest]
        if not candidates:
            return None
        engine, admins, name = min(candidates, key=lambda c: c[0].in_flight)
        self.adapters.pin(admins, name)
        return Pin(engine, admins, self.adapters.order[name][1], adapter=name)

    def unpin(self, pin: Pin) -> None:
        """Release a pin; engines it held back are moved to the newest weights (in the background)."""
        if pin.adapter is not None:  # LoRA: the adapter may go now
            self.adapters.unpin(pin.admins, pin.adapter)
            self.adapters.trim_later(pin.admins)
            return
        for i in pin.admins:
            self.pins[i] -= 1
            if not self.pins[i]:
                del self.pins[i]
        if not self._stopped and any(i in self.deferred and i not in self.pins for i in pin.admins):
            task = asyncio.ensure_future(self.refresh())
            self._refreshes.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._refreshes.discard)

    def _admins_of(self, engine: EngineEndpoint) -> tuple[int, ...]:
        """The admin engines behind a generation URL: the one with its URL, else (a router) all."""
        same = tuple(a.index for a in self.engines.admins if a.url == engine.url)
        return same or tuple(self._indices())

    def _indices(self) -> list[int]:
        """The admin engines' indices (never reused: services/rollout/clients/engine.py)."""
        return [a.index for a in self.engines.admins]

    def _urls(self, indices: list[int]) -> list[str]:
        urls = {a.index: a.url for a in self.engines.admins}
        return [urls[i] for i in indices if i in urls]

    # --- the fleet's changes (services/rollout/fleet.py) ----------------------------------------

    async def bring_up(self, engine: EngineEndpoint) -> int:
        """Bring `engine` (not an admin yet) to the weights the admins serve, check that it
        reports them, and make it an admin: every update from then on goes to it too. Under the
        update lock, so no update runs in between and no engine joins at a version the others
        have left. Returns the policy version it serves; raises `JoinRefused`. Call it once
        `caught_up` is set (before, the latest weights are not known here yet).

        The load, the long part (up to `update_timeout_s` on a slow or unreachable engine), runs
        first outside the lock, so the fleet's updates go on meanwhile (not to this engine: it
        is no admin yet); under the lock it is loaded again only if the weights moved since."""
        if self.lora:
            return await self._bring_up_adapter(engine)
        loaded = None
        if self.method != "distributed" and self.latest is not None:
            loaded = self.latest
            await self._load_joining(engine, loaded)
        async with self._lock:
            if self.method == "distributed":
                raise JoinRefused(
                    f"version {self.version} was broadcast by the trainer (publish = distributed), "
                    "which a new engine cannot receive: publish to disk for an elastic fleet"
                )
            want, version = None, (self._announced[1] if self._announced[1] >= 0 else None)
            if self.latest is not None:  # the disk weights of `version`
                want, version = (
                    weight_version_name(self.latest.version, self.latest.epoch),
                    self.latest.version,
                )
                if self.latest is not loaded:
                    await self._load_joining(engine, self.latest)
            reported = await self.engines.weight_version(engine)
            if reported is None:
                raise JoinRefused(f"{engine.url} reports no weight_version (unreachable, or not an engine)")
            served = policy_version(reported, self.initial_version)
            if (want is not None and reported != want) or (version is not None and served != version):
                raise JoinRefused(
                    f"{engine.url} serves weight_version {reported!r}, the fleet version {version}"
                    + ("" if want else " (nothing published to disk that it could load)")
                )
            self.engines.admins.append(engine)
            self.served[engine.index] = served
            await self._announce(served)  # the version a fleet with no engine so far moved to
            return served

    async def _bring_up_adapter(self, engine: EngineEndpoint) -> int:
        """`bring_up` with LoRA: the newest adapter loaded on `engine` (its base model is the one
        it started with, as on every engine), first outside the lock, then again under it if a
        newer one was announced meanwhile."""
        first = self.latest
        assert first is not None and first.adapter_name is not None
        self.adapters.announced(first)
        if (problem := await self.adapters.load(engine, first.adapter_name)) is not None:
            raise JoinRefused(f"loading the LoRA adapter of version {first.version}: {problem}")
        async with self._lock:
            info = self.latest
            assert info is not None and info.adapter_name is not None
            if info is not first and (problem := await self.adapters.load(engine, info.adapter_name)):
                raise JoinRefused(f"loading the LoRA adapter of version {info.version}: {problem}")
            self.engines.admins.append(engine)
            self.served[engine.index] = info.version
            return info.version

    async def _load_joining(self, engine: EngineEndpoint, weights: WeightsInfo) -> None:
        """Load `weights` into a joining engine whatever it reports: a version's name is not
        unique to a run, so an engine left over from another run (or one restarted onto other
        weights) may report this name over other weights."""
        name = weight_version_name(weights.version, weights.epoch)
        problem = await self.engines.update_from_disk(engine, weights.path or "", name)
        if problem is not None:
            raise JoinRefused(f"loading version {weights.version}: {problem}")

    async def retire(self, engine: EngineEndpoint) -> None:
        """No update goes to `engine` any more (it left the fleet, or died). Under the update
        lock: an update under way finishes (or fails on it) first."""
        async with self._lock:
            if engine in self.engines.admins:
                self.engines.admins.remove(engine)
            self.served.pop(engine.index, None)
            self.deferred.discard(engine.index)
            self.adapters.retire(engine.index)
