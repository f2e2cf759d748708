"""Membership of the engine fleet behind the real `sglang-router` (services/rollout/fleet.py):
a leave on one of two replicas must not leave the engine in the router through the other; the
router cannot join its own fleet.

A leave takes the engine out of the router, then out of the weight updates (after any update
under way: the update lock), then out of the roster. A replica that reads the roster and the
router in that window sees a serving member the router does not list and adds it back; when
it then finds the engine gone from the roster it must take it out of the router too, or the
router keeps sending requests to an engine that no replica updates any more."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import free_port, start_process

from asyncrl.buffer import Buffer, EngineRoster, PolicyVersions
from asyncrl.services.rollout.clients.engine import EngineClient
from asyncrl.services.rollout.clients.router import RouterClient
from asyncrl.services.rollout.engine_updates import WeightSync
from asyncrl.services.rollout.fleet import EngineFleet

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (pip install sglang-router)")

torch.set_num_threads(1)

JOIN_TIMEOUT_S = 20.0


@contextmanager
def fake_engine(answer: Callable[[str, str, dict], tuple[int, dict]]) -> Iterator[str]:
    """An HTTP server on loopback standing for an engine that misbehaves in a way a real one
    cannot be made to: `answer(method, path, json_body)` gives each request's status and JSON
    answer. Yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length", 0))
            status, reply = answer(
                self.command, self.path, json.loads(self.rfile.read(length)) if length else {}
            )
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def router(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "round_robin", "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    running = start_process(cmd, f"http://127.0.0.1:{port}", "/health", log_path=tmp_path / "router.log")
    yield running
    running.stop()


@pytest.fixture
def engine(tiny):
    running = serve_engine(str(tiny), max_running_requests=2, context_length=128)
    yield running
    running.stop()


class Replica:
    """One rollout replica's fleet: its own engine client, weight sync and router client, the
    run's roster."""

    def __init__(self, buf: Buffer, router_url: str):
        self.engines = EngineClient(
            [router_url],
            [],
            timeout_s=30.0,
            retries=0,
            backoff_s=0.05,
            unhealthy_after=2,
            probe_s=0.2,
            update_timeout_s=30.0,
        )
        self.weights = WeightSync(PolicyVersions(buf), self.engines, poll_s=0.2)
        self.router = RouterClient(router_url, timeout_s=30.0)
        self.fleet = EngineFleet(self.engines, self.weights, self.router, EngineRoster(buf), configured=[],
                                 probe_s=0.2, down_after=2, join_timeout_s=JOIN_TIMEOUT_S, sync_s=0.2)  # fmt: skip
        self._following: asyncio.Task | None = None

    async def start(self) -> None:
        self._following = asyncio.create_task(self.weights.run())
        await asyncio.wait_for(self.weights.caught_up.wait(), 10)

    async def sync(self) -> None:
        """One roster and router read, and the changes it starts, to their end."""
        await self.fleet._sync()
        while self.fleet._tasks:
            await asyncio.gather(*list(self.fleet._tasks))

    async def close(self) -> None:
        self._following.cancel()
        await asyncio.gather(self._following, return_exceptions=True)
        await self.engines.aclose()
        await self.router.aclose()


def test_a_leave_on_one_replica_is_not_undone_by_the_other(redis_url, run_id, router, engine):
    async def scenario() -> tuple[set[str], set[str], set[str], dict, dict]:
        buf = Buffer(redis_url, run_id)
        a, b = Replica(buf, router.url), Replica(buf, router.url)
        try:
            await a.start()
            await b.start()
            joined = await a.fleet.join(engine.url, 10)
            await b.sync()  # b finds the engine in the roster and brings it up too
            both = {a.fleet.view().engines[0].state, b.fleet.view().engines[0].state}
            assert (joined.state, both, set(await a.router.workers())) == (
                "serving",
                {"serving"},
                {engine.url},
            )

            # An update under way on a: its leave waits for it after the router let the engine go.
            async with a.weights._lock:
                leaving = asyncio.create_task(a.fleet.leave(engine.url))
                for _ in range(int(JOIN_TIMEOUT_S / 0.02)):  # until the router let it go
                    if engine.url not in await a.router.workers():
                        break
                    await asyncio.sleep(0.02)
                await b.sync()  # still in the roster, not in the router: b adds it back
                between = set(await b.router.workers())
            await leaving
            await b.sync()  # gone from the roster: b forgets it
            after = set(await b.router.workers())
            return between, after, set(EngineRoster(buf).members()), a.fleet.members, b.fleet.members
        finally:
            await a.close()
            await b.close()
            buf.close()

    between, after, listed, a_members, b_members = asyncio.run(scenario())
    assert between == {engine.url}  # (the window this test is about was hit)
    assert (after, listed, a_members, b_members) == (set(), set(), {}, {})


def test_the_router_cannot_join_its_own_fleet(monkeypatch, redis_url, run_id, tiny, router, engine):
    """Its own router named as an engine (an easy slip: the rollout's generation URL defaults to
    it) would be listed as its own worker, requests sent round in a loop, and weight updates
    sent to it: refused with a 422 that says why, nothing changed."""
    from fastapi.testclient import TestClient

    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.config import RolloutSettings
    from asyncrl.services.rollout.service import RolloutService
    from asyncrl.services.runtime.auth import API_TOKEN_ENV, ENGINE_TOKEN_ENV

    monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)
    closed = f"http://127.0.0.1:{free_port()}"
    settings = RolloutSettings(run=run_id, replica="r0", router_url=router.url, reward_url=closed,
                               tokenizer=str(tiny), weights_poll_s=0.2)  # fmt: skip
    with TestClient(build_app(RolloutService(settings, redis_url))) as client:
        joined = client.post("/v1/engines", json={"url": engine.url})
        assert joined.status_code == 200, joined.text
        refused = client.post("/v1/engines", json={"url": router.url + "/"})
        assert (refused.status_code, refused.json().get("detail")) == (
            422,
            f"{router.url} is this fleet's router, not an engine behind it",
        )
        assert [(e["url"], e["state"]) for e in client.get("/v1/engines").json()["engines"]] == [
            (engine.url, "serving")
        ]
    assert [w["url"] for w in httpx.get(f"{router.url}/workers").json()["workers"]] == [engine.url]


def test_a_sync_acts_on_the_roster_as_it_is_when_the_change_runs(redis_url, run_id, router, engine):
    """A sync reads the roster (in a thread: a join or leave on this replica goes on meanwhile)
    and then decides from that read. A join answered in between looks unlisted to it, and a
    leave answered in between looks listed: the forget and the join it then starts (under the
    engine's lock, after that change) must read the roster again, or it undoes the change."""
    from asyncrl.services.rollout.fleet import Member

    async def scenario():
        buf = Buffer(redis_url, run_id)
        a = Replica(buf, router.url)
        try:
            await a.start()
            assert (await a.fleet.join(engine.url, 10)).state == "serving"
            await a.fleet._forget(engine.url)  # what a sync that read the roster before the join starts
            kept = (a.fleet.members[engine.url].state, set(await a.router.workers()), a.weights._indices())
            await a.fleet.leave(engine.url)
            a.fleet.members[engine.url] = Member(engine.url)  # what a sync that read it before the leave does
            await a.fleet._join_listed(engine.url)  # ... and starts
            gone = (dict(a.fleet.members), set(await a.router.workers()), a.weights._indices())
            return kept, gone
        finally:
            await a.close()
            buf.close()

    kept, gone = asyncio.run(scenario())
    assert kept[:2] == ("serving", {engine.url}) and len(kept[2]) == 1
    assert gone == ({}, set(), [])


def test_a_joining_engine_is_loaded_even_when_it_reports_the_fleet_version(
    redis_url, run_id, tmp_path, router, engine, tiny
):
    """A version's name ("1") is not unique to a run: an engine left over from another run, or
    restarted onto other weights, can report the fleet's version over other weights. A join
    loads the published directory whatever the engine reports, so what it then serves under
    that name are the fleet's weights."""
    import time

    from safetensors.torch import load_file

    from asyncrl.proto import WeightsInfo
    from asyncrl.services.ops.tinymodel import build_tiny_model
    from asyncrl.services.transport.weights import weight_version_name

    published, other = tmp_path / "v1", tmp_path / "other"
    build_tiny_model(published, seed=11)
    build_tiny_model(other, seed=12)
    name = weight_version_name(1, 0)
    loaded = httpx.post(f"{engine.url}/update_weights_from_disk",
                        json={"model_path": str(other), "weight_version": name}, timeout=60)  # fmt: skip
    assert loaded.status_code == 200 and engine.engine.weight_version == name, loaded.text

    def served(key: str) -> torch.Tensor:
        return engine.engine.runner.model.state_dict()[key].detach().clone()

    want, impostor = load_file(published / "model.safetensors"), load_file(other / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(served(key), impostor[key]) and not torch.equal(want[key], impostor[key])

    async def scenario():
        buf = Buffer(redis_url, run_id)
        PolicyVersions(buf).publish(
            WeightsInfo(version=1, method="disk", path=str(published), published_at=time.time())
        )
        a = Replica(buf, router.url)
        try:
            await a.start()
            return await a.fleet.join(engine.url, 10)
        finally:
            await a.close()
            buf.close()

    joined = asyncio.run(scenario())
    assert (joined.state, joined.version, engine.engine.weight_version) == ("serving", 1, name)
    assert torch.equal(served(key), want[key])


def test_a_slow_join_does_not_hold_the_fleets_weight_updates(
    redis_url, run_id, router, engine, tiny, tmp_path
):
    """A joining engine's load can take up to `update_timeout_s` (a large model, a slow disk, a
    blackholed host): it runs outside the update lock, so the members' updates go on meanwhile;
    the joiner is loaded again under the lock when the weights moved during its load."""
    import time

    from asyncrl.proto import WeightsInfo
    from asyncrl.services.transport.weights import weight_version_name

    release, loading = threading.Event(), threading.Event()
    loads: list[str] = []
    state = {"weight_version": "default"}

    def slow(method: str, path: str, body: dict) -> tuple[int, dict]:
        """An engine whose /update_weights_from_disk takes until `release`."""
        if method == "GET":
            return 200, dict(state)
        if path == "/update_weights_from_disk":
            loads.append(body["model_path"])
            loading.set()
            release.wait(30)
            state["weight_version"] = body["weight_version"]
        return 200, {"success": True, "message": "ok"}

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for path in (v1, v2):
        shutil.copytree(tiny, path)

    async def scenario():
        buf = Buffer(redis_url, run_id)
        versions = PolicyVersions(buf)
        versions.publish(WeightsInfo(version=1, method="disk", path=str(v1), published_at=time.time()))
        a = Replica(buf, router.url)
        try:
            await a.start()
            assert (await a.fleet.join(engine.url, 10)).version == 1  # a member, at v1
            joining = asyncio.create_task(a.weights.bring_up(a.engines.new_admin(slow_url)))
            assert await asyncio.to_thread(loading.wait, 30)
            # while the joiner loads v1, v2 is published and the member moves to it
            versions.publish(WeightsInfo(version=2, method="disk", path=str(v2), published_at=time.time()))
            for _ in range(1000):
                if engine.engine.weight_version == weight_version_name(2, 0):
                    break
                await asyncio.sleep(0.02)
            member_moved = engine.engine.weight_version
            release.set()
            served = await asyncio.wait_for(joining, 30)
            return member_moved, served, state["weight_version"], list(loads)
        finally:
            release.set()
            await a.close()
            buf.close()

    with fake_engine(slow) as slow_url:
        member_moved, served, reported, loaded = asyncio.run(scenario())
    assert member_moved == weight_version_name(2, 0)  # the update did not wait for the join
    assert (served, reported, loaded) == (2, weight_version_name(2, 0), [str(v1), str(v2)])


def test_a_down_engine_that_cannot_load_is_retried_with_backoff(redis_url, run_id, router, tiny, tmp_path):
    """A listed engine that answers its health probes but refuses every load stays down, counted
    per failure, and is tried again after probe_s · 2, 4, 8 … (not at every probe): with probes
    every 0.1 s, 2.5 s hold at most 5 attempts (0.2 + 0.4 + 0.8 + 1.6 s of waits), where
    retrying at every probe would make about 25."""
    import time

    from asyncrl.proto import WeightsInfo
    from asyncrl.services.rollout import metrics as m

    loads: list[float] = []

    def broken(method: str, path: str, body: dict) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"weight_version": "default"}
        if path == "/update_weights_from_disk":
            loads.append(time.monotonic())
            return 400, {"success": False, "message": "cannot load"}
        return 200, {"success": True, "message": "ok"}

    failed = m.FLEET_CHANGES.labels("join_failed")

    async def scenario():
        buf = Buffer(redis_url, run_id)
        PolicyVersions(buf).publish(
            WeightsInfo(version=1, method="disk", path=str(tiny), published_at=time.time())
        )
        a = Replica(buf, router.url)
        a.fleet.probe_s = 0.1
        running = None
        try:
            await a.start()
            before = failed._value.get()
            EngineRoster(buf).add(url)  # listed (as by another replica): the sync joins it
            running = asyncio.create_task(a.fleet.run())
            await asyncio.sleep(2.5)  # time is the subject: how often the probes try again
            return a.fleet.members[url], failed._value.get() - before
        finally:
            if running is not None:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
            await a.close()
            buf.close()

    with fake_engine(broken) as url:
        member, counted = asyncio.run(scenario())
    gaps = [b - a for a, b in zip(loads, loads[1:])]
    assert (member.state, member.failed_joins, counted) == ("down", len(loads), len(loads))
    assert 2 <= len(loads) <= 5, loads
    assert all(gap >= 0.1 * 2 ** (i + 1) for i, gap in enumerate(gaps)), gaps


def test_a_removal_is_done_once_its_worker_is_gone_though_the_url_came_back(router, engine):
    """`RouterClient.remove` waits for the worker it deleted, by id: another replica that adds the
    URL back meanwhile (the router gives it a new id) makes a new worker, which is that
    replica's to undo, not this removal still pending (before, the removal waited for the URL
    to be unlisted and timed out)."""

    async def scenario():
        client = RouterClient(router.url, timeout_s=30.0)
        real, reads = client.workers, 0

        async def workers():
            nonlocal reads
            reads += 1
            if reads == 2:  # remove's first poll after its DELETE: another replica adds it back
                async with httpx.AsyncClient() as other:
                    await other.post(f"{router.url}/workers", json={"url": engine.url})
                for _ in range(500):
                    listed = await real()
                    if engine.url in listed and listed[engine.url]["id"] != first:
                        break
                    await asyncio.sleep(0.02)
            return await real()

        try:
            await client.add(engine.url, JOIN_TIMEOUT_S)
            first = (await real())[engine.url]["id"]
            client.workers = workers
            await client.remove(engine.url, 3.0)
            client.workers = real
            return first, await real()
        finally:
            await client.aclose()

    first, after = asyncio.run(scenario())
    assert engine.url in after and after[engine.url]["id"] != first
