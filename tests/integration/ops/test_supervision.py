"""Self-healing pieces on their own, with a real Redis and real processes (no model):

* buffer clients ride out a SIGKILLed Redis restarted in place from its AOF (`appendfsync
  always`: what a client saw acknowledged is still there), counted in the outage metrics;
* a retried `XREADGROUP` whose first reply was lost does not strand the delivered groups, and
  a re-sent dead-letter script does not dead-letter twice;
* the launcher's policy: a crashed service (and the embedded Redis) is restarted after an
  exponential backoff, counted on its /metrics; one crash over `max_restarts` stops the run
  with a message naming the service; the trainer's exit 0 ends the run.

The whole topology under kills is tests/e2e/test_supervised_topology.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import redis
from factories import make_group
from waiting import wait_until

from asyncrl.buffer import Buffer, Groups, PolicyVersions, TakeResult, stats
from asyncrl.buffer.connection import OUTAGES, TRAINER_GROUP, ReconnectRetry
from asyncrl.buffer.server import RedisServer, embedded_binary, free_port
from asyncrl.services.ops.launcher import Launcher, Proc
from asyncrl.services.ops.run_config import RunConfig
from asyncrl.services.runtime.metrics import serve_metrics

REPO = Path(__file__).resolve().parents[3]


def _outages(outcome: str) -> float:
    return OUTAGES.labels(outcome)._value.get()


def test_buffer_rides_out_a_redis_crash_and_keeps_what_was_acknowledged(tmp_path):
    server = RedisServer(tmp_path / "redis", binary=embedded_binary(), fsync="always").start()
    try:
        buf = Groups(Buffer(server.url, "heal"), "trainer-0")
        producer = Buffer(server.url, "heal")  # (another process: the rollout's)
        sub = PolicyVersions(producer).subscribe()
        assert Groups(producer).put([make_group(f"g{i}") for i in range(3)]) == [True] * 3
        assert [g.group_id for g in buf.take(2, 0, block_ms=100).groups] == ["g0", "g1"]
        assert buf.ack(["g0"]) == 1
        recovered = _outages("recovered")

        server.kill()  # SIGKILL: no AOF flush beyond what `always` already wrote
        restart = threading.Timer(1.5, server.start)
        restart.start()
        t0 = time.monotonic()
        # every call below starts while Redis is down and waits for it
        assert Groups(producer).put([make_group("g3")]) == [True]
        assert time.monotonic() - t0 > 1.0
        restart.join()
        assert buf.ack(["g1"]) == 1
        taken = buf.take(5, 0, block_ms=200).groups
        assert [g.group_id for g in taken] == ["g2", "g3"]  # nothing lost, nothing twice
        assert buf.ack(["g2", "g3"]) == 2
        numbers = stats(buf.buf)
        assert numbers["counters"]["put"] == 4 and numbers["counters"]["trained"] == 4
        assert numbers["pending"]["groups"] == 0 and numbers["depth"]["groups"] == 0
        assert _outages("recovered") >= recovered + 1
        sub.get(0.2)  # the subscription reconnects (and re-subscribes) too
        PolicyVersions(producer).publish(make_weights(1))
        assert _next_weights(sub).version == 1
        sub.close()
        buf.buf.close()
        producer.close()
    finally:
        server.stop()


def make_weights(version: int):
    from asyncrl.proto import WeightsInfo

    return WeightsInfo(version=version, method="disk", path=f"/w/{version}", published_at=time.time())


def _next_weights(sub, timeout: float = 5.0):
    return wait_until(
        lambda: sub.get(0.5), timeout=timeout, interval=0, message="a weights event after the restart"
    )


def test_client_gives_up_after_its_budget():
    port = free_port()  # nothing listens there
    gave_up = _outages("gave_up")
    client = redis.Redis(port=port, retry=ReconnectRetry("test", budget_s=0.6))
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert 0.5 < time.monotonic() - t0 < 5
    assert _outages("gave_up") == gave_up + 1


def test_a_lost_read_reply_is_handed_out_after_the_outage(redis_url, run_id):
    """XREADGROUP ran, its reply never arrived (Redis died while sending it): the entries are in
    this consumer's pending list, unseen. After the outage the buffer hands them out, once."""
    conn = Buffer(redis_url, run_id)
    buf = Groups(conn, "trainer-0")
    buf.put([make_group("a"), make_group("b"), make_group("c")])
    assert [g.group_id for g in buf.take(1, 0, block_ms=50).groups] == ["a"]  # held, not yet acked
    conn.redis.xreadgroup(TRAINER_GROUP, "trainer-0", {conn.keys.groups: ">"}, count=1)  # "b": the lost reply
    conn.retry.outages += 1  # what ReconnectRetry records when the connection broke
    taken = [g.group_id for g in buf.take(5, 0, block_ms=50).groups]
    assert taken == ["b", "c"]  # "a" is held already: not handed out twice
    assert buf.ack(["a", "b", "c"]) == 3
    assert stats(conn)["pending"]["groups"] == 0
    conn.close()


def test_a_resent_dead_letter_script_does_not_count_twice(redis_url, run_id):
    conn = Buffer(redis_url, run_id)
    k = conn.keys
    eid = conn.redis.xadd(k.groups, {"gid": "bad"}).decode()
    conn.redis.hset(k.group_state, "bad", "buffered")
    conn.redis.hset(k.group_entry, "bad", eid)
    conn.redis.xreadgroup(TRAINER_GROUP, "trainer-0", {k.groups: ">"}, count=1)
    for _ in range(2):  # the second run is the re-send after a lost reply
        Groups(conn, "trainer-0")._decode(eid, {b"gid": b"bad"}, b"not msgpack", TakeResult())
    assert conn.redis.xlen(k.deadletter) == 1 and stats(conn)["counters"]["dead_lettered"] == 1
    conn.close()


class _Engines:
    """The part of EngineClient that WeightSync's restart check uses; `served` is what each
    engine reports as its weight_version."""

    def __init__(self, served: list[str]):
        from asyncrl.services.rollout.clients.engine import EngineEndpoint

        self.served, self.updates = served, []
        self.admins = [EngineEndpoint(i, f"http://engine-{i}") for i in range(len(served))]

    async def weight_versions(self, only=None) -> list[str]:
        return list(self.served)

    async def update_all_from_disk(self, path: str, version: str, only: list[int]) -> list[str]:
        self.updates.append((path, version, tuple(only)))
        for i in only:
            self.served[i] = version
        return []


def test_a_restarted_engine_is_moved_back_to_the_newest_weights():
    """A restarted engine serves its start weights, and a trainer that waits for fresh groups
    publishes nothing that would move it: the rollout's poll notices and reloads it."""
    import asyncio

    from asyncrl.services.rollout.engine_updates import WeightSync

    engines = _Engines(["5", "5", "5"])
    sync = WeightSync(None, engines, poll_s=1.0)
    sync.version, sync.method, sync.latest = 5, "disk", make_weights(5)
    asyncio.run(sync._reload_restarted())
    assert engines.updates == []  # all at the newest: nothing to do
    engines.served[1] = engines.served[2] = "0"  # engines 1 and 2 restarted; 2 is pinned by an evaluation
    sync.pins[2] = 1
    asyncio.run(sync._reload_restarted())
    assert engines.updates == [("/w/5", "5", (1,))] and sync.served[1] == 5
    assert engines.served == ["5", "5", "0"]


# --------------------------------------------------------------------------- the launcher's policy

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]  # a stand-in service that runs until killed


def _launcher(tmp_path: Path, **launch) -> Launcher:
    raw = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    raw["run"].update(id="sup", dir=str(tmp_path / "run"))
    raw["model"]["path"] = str(tmp_path / "base")
    raw["launch"].update(metrics_port=free_port(), restart_backoff_s=0.2, restart_backoff_max_s=0.4,
                         max_restarts=2, **launch)  # fmt: skip
    return Launcher(RunConfig.model_validate(raw), tmp_path / "x.toml", echo=False)


def _supervise_until(launcher: Launcher, predicate, timeout: float = 20.0) -> int | None:
    """Run the supervision loop until it ends (its outcome) or `predicate` holds (None)."""
    outcome = None

    def there() -> bool:
        nonlocal outcome
        outcome = launcher.supervise()
        return outcome is not None or predicate()

    wait_until(there, timeout=timeout, interval=0.05, message="supervision gets there")
    return outcome


def _start_fake(launcher: Launcher, *names: str) -> None:
    """Embedded Redis and metrics as `start` does them, with sleepers for services."""
    launcher.cfg.model.build_tiny = False
    launcher.prepare()
    launcher._env = dict(os.environ)
    launcher._metrics_server = serve_metrics(
        "127.0.0.1", launcher.cfg.launch.metrics_port, launcher.registry, thread_name="launcher-metrics"
    )
    for name in names:
        proc = Proc(name, list(SLEEPER), None)
        launcher._spawn(proc)
        proc.healthy = True
        launcher.procs.append(proc)


def _metric(launcher: Launcher, line_start: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{launcher.cfg.launch.metrics_port}/metrics", timeout=5).text
    values = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start)]
    return values[0] if values else 0.0


def test_launcher_restarts_with_backoff_then_stops_over_budget(tmp_path):
    launcher = _launcher(tmp_path)
    try:
        _start_fake(launcher, "reward-0", "engine-0")
        reward = launcher.find("reward-0")
        delays = []
        for n in (1, 2):
            old = reward.popen.pid
            os.kill(old, signal.SIGKILL)
            t0 = time.monotonic()
            assert (
                _supervise_until(launcher, lambda old=old: reward.alive and reward.popen.pid != old) is None
            )
            delays.append(time.monotonic() - t0)
            assert reward.restarts == n
        assert 0.15 < delays[0] < delays[1]  # 0.2 s, then 0.4 s
        assert _metric(launcher, 'asyncrl_launcher_restarts_total{service="reward-0"}') == 2
        assert launcher.find("engine-0").restarts == 0
        # Redis: killed, restarted in place (same port), its data kept
        client = redis.Redis.from_url(launcher.redis_url, retry=ReconnectRetry("test"))
        client.set("kept", "1")
        os.kill(launcher.redis.proc.pid, signal.SIGKILL)
        launcher.redis.proc.wait()
        assert (
            _supervise_until(launcher, lambda: launcher.redis_proc.restarts == 1 and launcher.redis.alive)
            is None
        )
        assert client.get("kept") == b"1"
        assert _metric(launcher, 'asyncrl_launcher_restarts_total{service="redis"}') == 1
        # a third crash of reward-0 is one more than max_restarts = 2
        os.kill(reward.popen.pid, signal.SIGKILL)
        reward.popen.wait()
        assert _supervise_until(launcher, lambda: False) == 1
        assert "reward-0 exited with -9 after 2 restart(s)" in launcher.stop_reason
        assert "max_restarts = 2" in (tmp_path / "run" / "logs" / "launcher.log").read_text()
    finally:
        launcher.stop()
    assert launcher.redis is None


def test_trainer_exit_0_ends_the_run_and_a_crash_does_not(tmp_path):
    launcher = _launcher(tmp_path)
    try:
        _start_fake(launcher)
        trainer = Proc("trainer", [sys.executable, "-c", "import sys; sys.exit(3)"], None)
        launcher._spawn(trainer)
        launcher.procs.append(trainer)
        trainer.popen.wait()
        assert launcher.supervise() is None and trainer.restart_at is not None  # exit 3: a crash
        trainer.cmd = [sys.executable, "-c", "pass"]
        assert _supervise_until(launcher, lambda: False) == 0
        assert launcher.stop_reason == "trainer finished (exit 0)" and trainer.restarts == 1
    finally:
        launcher.stop()


def test_a_service_that_stops_answering_is_restarted(tmp_path):
    """Alive but failing its health check (e.g. a rollout whose scheduler loop died: 503):
    after `liveness_failures` probes in a row it is killed and restarted like a crash."""
    launcher = _launcher(tmp_path, liveness_interval_s=0.1, liveness_failures=3)
    port = free_port()
    sick = (
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(503); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    try:
        _start_fake(launcher)
        rollout = Proc("rollout-0", [sys.executable, "-c", sick], f"http://127.0.0.1:{port}/healthz")
        launcher._spawn(rollout)
        rollout.healthy = True  # it was, at start
        launcher.procs.append(rollout)
        first = rollout.popen.pid
        assert (
            _supervise_until(launcher, lambda: rollout.restarts == 1 and rollout.popen.pid != first) is None
        )
        assert _metric(launcher, 'asyncrl_launcher_health_check_failures_total{service="rollout-0"}') == 3
        assert _metric(launcher, 'asyncrl_launcher_service_up{service="rollout-0"}') == 0
        log = (tmp_path / "run" / "logs" / "launcher.log").read_text()
        assert "rollout-0 failed 3 health checks in a row" in log and "restart 1/2" in log
    finally:
        launcher.stop()


def test_a_second_signal_does_not_cut_the_shutdown_short():
    """`asyncrl up` / `asyncrl demo` stop on the first SIGTERM or SIGINT like Ctrl-C, and ignore
    the ones after it (`timeout` and `pkill` both signalling left services running when the
    second landed in the shutdown)."""
    program = (
        "import os, signal, time\n"
        "from asyncrl.services.ops.launcher import stop_on_first_signal\n"
        "stop_on_first_signal()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "finally:\n"
        "    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):\n"
        "        os.kill(os.getpid(), sig)\n"
        "        time.sleep(0.05)\n"
        "    print('shutdown finished', flush=True)\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "shutdown", "finished"]
