"""The engine fleet behind an sglang-router (`router_url`; docs/architecture.md §7): which engines
serve, and in which order one joins and leaves, so that no engine serves weights the fleet has
left and no weight update misses an engine that serves.

* **join** (`POST /v1/engines`; `engine_admin_urls` at start; an engine another replica listed):
  listed in the roster (Redis, `buffer/roster.py`) → brought to the current weights and checked
  (`WeightSync.bring_up`, under the update lock: from then on every update goes to it) → added to
  the router, and waited for until the router lists it healthy. Only then can a request reach
  it, so it never serves a version older than the fleet's (a new engine starts at its own).
* **leave** (`DELETE /v1/engines?url=`): out of the router first (no new request reaches it),
  then out of the updates, then out of the roster. Requests it still runs finish under the
  version it has, and their tokens say so.
* **down**: an engine that does not answer `GET /health` (refused, reset, timed out)
  `engine_unhealthy_after` probes in a row, one every `engine_probe_s`, is taken out of the
  router and out of the updates; it stays in the roster, and joins again (brought to the
  current weights first) once it answers. A join that fails leaves it down, tried again after
  `engine_probe_s` · 2^failures (at most `MAX_REJOIN_BACKOFF_S`), each failure counted.
* Every `weights_poll_s` the roster is read again (the joins and leaves of other replicas: an
  engine no longer listed is taken out of the router, and out of the updates here) and the
  router's list repaired (a restarted router lists no one; a down engine is taken out). A join
  or forget a sync starts reads the roster again under the engine's lock: a join or leave
  answered since the sync's read is not undone.

An engine that dies with requests in flight loses nothing that was received: `/generate` is not
streamed, so the tokens of the attempt it was running never reached the rollout. sglang-router
sends the same request again to another worker (its retries); past them, the rollout's engine
client retries the segment, and past those the group goes on another engine from its last
received segment (`GroupScheduler._generate`). Every kept token keeps the version its engine
reported, and the new tokens carry the version of the engine that samples them.

Limits: the fleet is the rollout's, not the router's: workers the router lists that are not
members are left alone. A fleet needs disk weights (`publish = "disk"`): a joining engine cannot
receive the trainer's broadcast. Membership changes by one replica reach the others at their
next roster read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import redis

from asyncrl.buffer import EngineRoster
from asyncrl.proto.fleet import FleetEngine, FleetEngines
from asyncrl.proto.states import EngineState
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import EngineClient, EngineEndpoint
from asyncrl.services.rollout.clients.router import RouterClient, RouterError
from asyncrl.services.rollout.engine_updates import JoinRefused, WeightSync
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

PROBE_TIMEOUTS = 5  # a health probe may take this many probe intervals before it counts as a miss
# A down engine that answers its probes but fails to join (a load it cannot do, a router that
# refuses it) is tried again after probe_s · 2^failures, at most this long: without a bound on
# the rate, a broken engine would be reloaded at every probe for ever.
MAX_REJOIN_BACKOFF_S = 60.0


class NotAMember(Exception):
    """`DELETE /v1/engines` of an engine the fleet does not have."""


class NotAnEngine(ValueError):
    """`POST /v1/engines` of the fleet's own router: it would be listed as its own worker (requests
    sent round in a loop) and sent weight updates."""


class FleetNotReady(Exception):
    """The weights have not been caught up with since the start: no engine can join yet."""


@dataclass(eq=False)
class Member:
    url: str
    state: EngineState = EngineState.joining
    endpoint: EngineEndpoint | None = None  # while it is an admin (in the weight updates)
    since: float = field(default_factory=time.time)
    error: str = ""
    misses: int = 0  # health probes in a row it did not answer
    failed_joins: int = 0  # joins in a row that failed (reset by one that succeeds)
    retry_at: float = 0.0  # time.monotonic() before which a down engine is not joined again

    def enter(self, state: EngineState, error: str = "") -> None:
        self.state, self.since, self.error, self.misses = state, time.time(), error, 0


class EngineFleet:
    def __init__(
        self,
        engines: EngineClient,
        weights: WeightSync,
        router: RouterClient,
        roster: EngineRoster,
        *,
        configured: list[str],
        probe_s: float,
        down_after: int,
        join_timeout_s: float,
        sync_s: float,
    ):
        self.engines, self.weights, self.router, self.roster = engines, weights, router, roster
        self.configured = set(configured)  # engine_admin_urls: members at every start
        self.probe_s, self.down_after = probe_s, down_after
        self.join_timeout_s, self.sync_s = join_timeout_s, sync_s
        self.members: dict[str, Member] = {}
        # One change per engine at once (a join, a leave, going down); the probes skip an engine
        # whose change is under way.
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: set[asyncio.Task] = set()

    # --- the API (routes/engines.py) ----------------------------------------------------------

    def view(self) -> FleetEngines:
        """The members, in URL order."""
        return FleetEngines(
            router=self.router.url, engines=[self._describe(self.members[u]) for u in sorted(self.members)]
        )

    def _describe(self, member: Member) -> FleetEngine:
        version = self.weights.served.get(member.endpoint.index) if member.endpoint is not None else None
        return FleetEngine(
            url=member.url, state=member.state, version=version, since=member.since, error=member.error
        )

    async def join(self, url: str, wait_s: float) -> FleetEngine:
        """Add `url` to the fleet (see the module docstring); an engine already serving is left as
        it is. Raises `JoinRefused` or `RouterError` (a new member is then forgotten; a down one
        stays down), `FleetNotReady` when the weights were not caught up with in `wait_s`,
        `NotAnEngine` for the router itself (another name for it is not recognised)."""
        if url == self.router.url.rstrip("/"):
            raise NotAnEngine(f"{url} is this fleet's router, not an engine behind it")
        try:
            await asyncio.wait_for(self.weights.caught_up.wait(), wait_s)
        except TimeoutError:
            raise FleetNotReady("the rollout has not caught up with the published weights yet") from None
        async with self._locks[url]:
            known = self.members.get(url)
            if known is not None and known.state is EngineState.serving:
                return self._describe(known)
            await asyncio.to_thread(self.roster.add, url)
            try:
                await self._bring_up(url, "joined" if known is None else "rejoined")
            except (JoinRefused, RouterError):
                if known is None and url not in self.configured:
                    self.members.pop(url, None)
                    await asyncio.to_thread(self.roster.remove, url)
                    self._count()
                raise
            return self._describe(self.members[url])

    async def leave(self, url: str) -> None:
        """Take `url` out of the router, then out of the updates and the roster. Raises
        `NotAMember`, or `RouterError` (then nothing changed)."""
        async with self._locks[url]:
            listed = url in await asyncio.to_thread(self.roster.members)
            member = self.members.get(url)
            if member is None and not listed:
                raise NotAMember(f"{url} is not an engine of this fleet")
            await self.router.remove(url, self.join_timeout_s)
            if member is not None and member.endpoint is not None:
                await self.weights.retire(member.endpoint)
            await asyncio.to_thread(self.roster.remove, url)
            self.members.pop(url, None)
            self.configured.discard(url)  # (until a restart: engine_admin_urls join at every start)
            m.FLEET_CHANGES.labels("left").inc()
            self._count()
            log_event(log, "engine left the fleet", engine=url)

    # --- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: once the weights are caught up with, join every member; then probe them
        every `probe_s` and read the roster and the router's list every `sync_s`."""
        try:
            await self.weights.caught_up.wait()
            next_sync = time.monotonic()
            while True:
                if time.monotonic() >= next_sync:
                    await self._sync()
                    next_sync = time.monotonic() + self.sync_s
                await asyncio.gather(*(self._probe(mb) for mb in list(self.members.values())))
                await asyncio.sleep(self.probe_s)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _sync(self) -> None:
        """Join the engines listed (by any replica) that are not members here, forget the ones
        no longer listed, and make the router's list agree with the members' states."""
        try:
            listed = set(await asyncio.to_thread(self.roster.members)) | self.configured
        except redis.RedisError as exc:  # the next sync reads it again
            m.FLEET_SYNC_ERRORS.labels("redis").inc()
            log_event(log, "engine roster not read", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            return
        for url in sorted(listed - set(self.members)):
            self.members[url] = Member(url)
            self._background(self._join_listed(url))
        for url in sorted(set(self.members) - listed):
            self._background(self._forget(url))
        try:
            routed = await self.router.workers()
        except RouterError as exc:
            m.FLEET_SYNC_ERRORS.labels("router").inc()
            log_event(log, "router's workers not read", logging.WARNING, error=str(exc))
            return
        for member in list(self.members.values()):
            if member.url not in listed:
                continue  # being forgotten: never added back
            wrong = (member.state is EngineState.serving) != (member.url in routed)
            if wrong and member.state is not EngineState.joining and not self._locks[member.url].locked():
                self._background(self._repair(member.url))

    async def _listed(self, url: str) -> bool | None:
        """Whether the roster lists `url` now (None: not read, counted). A sync decides from a
        roster read that a join or leave under way (on this replica or another) may have
        changed since: each change it starts asks again under the engine's lock."""
        if url in self.configured:
            return True
        try:
            return url in await asyncio.to_thread(self.roster.members)
        except redis.RedisError as exc:
            m.FLEET_SYNC_ERRORS.labels("redis").inc()
            log_event(log, "engine roster not read", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            return None

    async def _join_listed(self, url: str) -> None:
        async with self._locks[url]:
            member = self.members.get(url)
            if member is None or member.state is not EngineState.joining:
                return
            if not await self._listed(url):  # left meanwhile (or unread: the next sync asks again)
                self.members.pop(url, None)
                return
            await self._bring_up_quietly(url, "joined")

    async def _forget(self, url: str) -> None:
        """An engine another replica took out of the fleet: out of the router (this replica may
        have added it back while that leave was under way: its sync saw it listed, and not
        routed), then out of the updates here. Kept while the router fails: the next sync
        tries again."""
        async with self._locks[url]:
            member = self.members.get(url)
            if member is None or await self._listed(url) is not False:
                return  # joined again meanwhile (or unread: the next sync asks again)
            try:
                await self.router.remove(url, self.join_timeout_s)
            except RouterError as exc:  # counted in asyncrl_rollout_router_calls_total
                log_event(log, "engine left by another replica still in the router", logging.WARNING,
                          engine=url, error=str(exc))  # fmt: skip
                return
            self.members.pop(url, None)
            if member.endpoint is not None:
                await self.weights.retire(member.endpoint)
            self._count()

    async def _repair(self, url: str) -> None:
        async with self._locks[url]:
            member = self.members.get(url)
            if member is None:
                return
            try:
                if member.state is EngineState.serving:
                    log_event(
                        log, "engine missing from the router: adding it again", logging.WARNING, engine=url
                    )
                    await self.router.add(url, self.join_timeout_s)
                elif member.state is EngineState.down:
                    await self.router.remove(url, self.join_timeout_s)
            except RouterError as exc:
                log_event(log, "router not repaired", logging.WARNING, engine=url, error=str(exc))

    async def _probe(self, member: Member) -> None:
        """One health probe: a serving engine that missed `down_after` in a row goes down; a down
        engine that answers joins again (both in the background: the probes go on)."""
        if member.state is EngineState.joining or self._locks[member.url].locked():
            return  # a change is under way: it decides
        answered = await self.engines.reachable(member.url, self.probe_s * PROBE_TIMEOUTS)
        if member.state is EngineState.serving:
            member.misses = 0 if answered else member.misses + 1
            if member.misses >= self.down_after:
                self._background(self._change(member, EngineState.serving, self._take_down))
        elif member.state is EngineState.down and answered and time.monotonic() >= member.retry_at:
            self._background(self._change(member, EngineState.down, self._rejoin))

    async def _change(self, member: Member, state: EngineState, change) -> None:
        """`change(member)` under its engine's lock, if it is still a member in `state`."""
        async with self._locks[member.url]:
            if self.members.get(member.url) is member and member.state is state:
                await change(member)

    async def _rejoin(self, member: Member) -> None:
        await self._bring_up_quietly(member.url, "rejoined")

    # --- the changes (each under its engine's lock) -------------------------------------------

    async def _bring_up(self, url: str, change: str) -> None:
        """Current weights, checked, then the router (see the module docstring)."""
        member = self.members.setdefault(url, Member(url))
        member.enter(EngineState.joining)
        self._count()
        endpoint = self.engines.new_admin(url)
        try:
            version = await self.weights.bring_up(endpoint)
            try:
                await self.router.add(url, self.join_timeout_s)
            except RouterError:
                await self.weights.retire(endpoint)
                raise
        except (JoinRefused, RouterError) as exc:
            member.enter(EngineState.down, str(exc))
            member.failed_joins += 1
            member.retry_at = time.monotonic() + min(
                MAX_REJOIN_BACKOFF_S, self.probe_s * 2**member.failed_joins
            )
            m.FLEET_CHANGES.labels("join_failed").inc()
            self._count()
            log_event(log, "engine did not join the fleet", logging.WARNING, engine=url, error=str(exc))
            raise
        member.endpoint = endpoint
        member.enter(EngineState.serving)
        member.failed_joins = 0
        m.FLEET_CHANGES.labels(change).inc()
        self._count()
        log_event(log, f"engine {change} the fleet", engine=url, version=version)

    async def _bring_up_quietly(self, url: str, change: str) -> None:
        """`_bring_up` where nobody waits for the answer: a failure leaves it down (counted,
        logged), and the probes try again once it answers."""
        try:
            await self._bring_up(url, change)
        except (JoinRefused, RouterError):
            pass

    async def _take_down(self, member: Member) -> None:
        """Out of the router (no new request reaches it), out of the updates (none waits on it)."""
        why = f"did not answer {member.misses} health probes in a row"
        try:
            await self.router.remove(member.url, self.join_timeout_s)
        except RouterError as exc:  # the next sync takes it out of the router
            why += f"; not yet out of the router: {exc}"
        if member.endpoint is not None:
            await self.weights.retire(member.endpoint)
            member.endpoint = None
        member.enter(EngineState.down, why)
        m.FLEET_CHANGES.labels("down").inc()
        self._count()
        log_event(log, "engine down: out of the router and of weight updates", logging.WARNING,
                  engine=member.url, reason=why)  # fmt: skip

    def _count(self) -> None:
        for state in EngineState:
            m.FLEET_ENGINES.labels(state.value).set(sum(mb.state is state for mb in self.members.values()))

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
