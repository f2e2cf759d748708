"""`asyncrl train` across two network hosts: two Linux network namespaces, each with its own
address, one torchrun agent and one gloo rank each, joined by c10d rendezvous over a veth link.

Topology (made by the `hosts` fixture, torn down whatever happens; names and subnets unique per run):

    ns1 (node 1)  peer0 10.77.a.1 ──veth── peer0 10.77.a.2  ns2 (node 2)
                  up0   10.77.b.1                   up0 10.77.c.2
                   │                                 │
    root ns:  10.77.b.254 (redis-server) ──── 10.77.c.254   (no forwarding: Redis is local to root;
                                                             ns2's one route off its links: to b.254)

Both nodes run the same command with the same config file from one shared directory (one
filesystem stands in for the shared storage the checkpoints need, docs/architecture.md §6). In
the first test the buffer is fed directly, as in tests/integration/trainer/test_trainer.py, so the accounting is
exact: 16 groups, 2 per step, a checkpoint every 2 steps, max_steps 8. After step 3 (checkpoint
at v=2, g04 and g05 consumed but not acked) the test SIGKILLs node 2's worker; both agents
restart their workers (a new rendezvous round), the run resumes from v=2 and reclaims g04, g05,
and at the end every group is in the surviving lineage exactly once and acked exactly once. The
second test feeds the same two hosts from the demo topology's engine, reward and rollout services.

Root is required (network namespaces); without it the test fails saying so.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from factories import make_group
from waiting import wait_until

from asyncrl.buffer import Buffer, Groups, stats
from asyncrl.buffer.server import RedisServer

# `make test-extended` (.ci/run's second stage): root network namespaces, ~2 min
pytestmark = pytest.mark.extended

ROOT = Path(__file__).resolve().parents[2]
B, STEPS, CHECKPOINT_EVERY = 2, 8, 2
RDZV_PORT = 29400
PEER_IF = "peer0"  # the node-to-node link, the same name inside both namespaces


@dataclass
class Hosts:
    """Two namespaces ("hosts") and their addresses."""

    ns: tuple[str, str]
    peer: tuple[str, str]  # node 1 and node 2 on the node-to-node link
    redis_addr: str  # in the root namespace, reached by both over their up0 links

    def ip(self, node: int, *args: str) -> None:
        _ip("-n", self.ns[node - 1], *args)


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL whatever still runs inside `ns`, then delete it (its veth ends, and so their peers
    in the root namespace, go with it)."""
    for pid in _ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.fail("this test needs root: it creates two network namespaces (ip netns add) as its nodes")
    token = uuid.uuid4().hex[:6]
    ns = (f"arl{token}n1", f"arl{token}n2")
    up = (f"arl{token}u1", f"arl{token}u2")  # the root-side ends of the up0 links
    # three /24s: 10.77.a (node to node), .b (ns1-root), .c (ns2-root); b, c not in use in the root
    # namespace (another run of this test)
    taken = subprocess.run(["ip", "-4", "route"], check=False, capture_output=True, text=True).stdout
    a = random.choice(
        [k for k in range(0, 252, 3) if f"10.77.{k + 1}." not in taken and f"10.77.{k + 2}." not in taken]
    )
    b, c = a + 1, a + 2
    try:
        for name in ns:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", PEER_IF, "netns", ns[0], "type", "veth", "peer", "name", PEER_IF, "netns", ns[1])
        for i, (name, root_end, subnet) in enumerate(zip(ns, up, (b, c), strict=True), start=1):
            _ip("-n", name, "addr", "add", f"10.77.{a}.{i}/24", "dev", PEER_IF)
            _ip("-n", name, "link", "set", PEER_IF, "up")
            _ip("link", "add", root_end, "type", "veth", "peer", "name", "up0", "netns", name)
            _ip("addr", "add", f"10.77.{subnet}.254/24", "dev", root_end)
            _ip("link", "set", root_end, "up")
            _ip("-n", name, "addr", "add", f"10.77.{subnet}.{i}/24", "dev", "up0")
            _ip("-n", name, "link", "set", "up0", "up")
        # node 2 reaches Redis through its own link; no default route, so nothing in either
        # namespace (a DNS lookup of a peer's address, say) can leave for any other address
        _ip("-n", ns[1], "route", "add", f"10.77.{b}.254/32", "via", f"10.77.{c}.254")
        yield Hosts(ns=ns, peer=(f"10.77.{a}.1", f"10.77.{a}.2"), redis_addr=f"10.77.{b}.254")
    finally:
        for name in ns:
            _kill_namespace(name)
        for root_end in up:  # gone with their namespaces; this catches a half-made setup
            subprocess.run(["ip", "link", "del", root_end], check=False, capture_output=True)


def read_audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def workers_of(pid: int) -> list[int]:
    """The trainer workers (`… --worker …`) below torchrun's process `pid`."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], check=False, capture_output=True,
                              text=True).stdout.split()  # fmt: skip
    found = []
    for child in map(int, children):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        found += [child] if b"--worker" in cmdline else workers_of(child)
    return found


def start_node(
    hosts: Hosts, node: int, config: Path, log: Path, rdzv_id: str, *extra: str
) -> subprocess.Popen:
    """`asyncrl train` on one host: the same command on both but for this host's own address
    and, on node 1, `is_host` (it serves the c10d store at the rendezvous endpoint)."""
    cmd = ["ip", "netns", "exec", hosts.ns[node - 1], sys.executable, "-m", "asyncrl.services.ops.cli", "train",
           "--config", str(config), "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.peer[0]}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
           "--rdzv-conf", f"is_host={'true' if node == 1 else 'false'}",
           "--local-addr", hosts.peer[node - 1], "--max-restarts", "3", *extra]  # fmt: skip
    # gloo binds the address of the interface named here (its default, the hostname's address,
    # is the root namespace's and unreachable from the other host)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": PEER_IF}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


@pytest.mark.timeout(480)  # ~3 min on 2 loaded cores; the waits below allow for a slower CI machine
def test_two_hosts_survive_a_killed_rank_exactly_once(tmp_path, hosts, run_id):
    from asyncrl.services.ops.tinymodel import build_tiny_model

    shared = tmp_path / "shared"  # what both hosts mount: model, config, checkpoints, audit log
    build_tiny_model(shared / "tiny", seed=5)
    # off loopback Redis wants a password (protected mode), as any deployment across hosts should
    password = uuid.uuid4().hex
    redis = RedisServer(tmp_path / "redis", bind=(hosts.redis_addr,), password=password).start()
    url = f"redis://:{password}@{hosts.redis_addr}:{redis.port}/0"
    out = shared / "out"
    config = shared / "run.toml"
    config.write_text(f"""
[trainer]
redis_url = "{url}"
run = "{run_id}"
model_path = "{shared / "tiny"}"
output_dir = "{out}"
batch_groups = {B}
max_staleness = 100
max_steps = {STEPS}
checkpoint_every = {CHECKPOINT_EVERY}
micro_batch_size = 2
heartbeat_s = 0.3
lr = 0.001
publish = "none"
block_ms = 200
device = "cpu"
""")
    buf = Buffer(redis.url, run_id)
    groups = [make_group(f"g{k:02d}", seed=k) for k in range(B * STEPS)]
    for g in groups[:6]:  # phase 1: three steps' worth
        assert Groups(buf).put([g]) == [True]
    audit = out / "trained.jsonl"
    logs = [tmp_path / f"node{i}.log" for i in (1, 2)]
    nodes: list[subprocess.Popen] = []

    def events() -> list[dict]:
        return read_audit(audit) if audit.exists() else []

    def alive() -> None:
        for i, p in enumerate(nodes, start=1):
            assert p.poll() is None, f"node {i} exited ({p.returncode}): {logs[i - 1].read_text()[-3000:]}"

    def stepped(v: int) -> bool:
        alive()
        return any(e["event"] == "step" and e["version"] == v for e in events())

    try:
        nodes = [start_node(hosts, i, config, logs[i - 1], run_id) for i in (1, 2)]
        wait_until(lambda: stepped(3), timeout=150, interval=0.2, message="step 3 on two hosts")
        # g04, g05 trained in v=3 but not checkpointed: consumed, unacked
        wait_until(lambda: alive() or stats(buf)["pending"]["groups"] == 2, timeout=30, interval=0.2,
                   message="the trainer waits for data holding g04, g05 unacked")  # fmt: skip
        before = [workers_of(p.pid) for p in nodes]
        assert [len(w) for w in before] == [1, 1], before
        os.kill(before[1][0], signal.SIGKILL)  # node 2's rank 1 dies; both agents live on
        wait_until(lambda: alive() or sum(e["event"] == "resume" for e in events()) >= 2, timeout=120,
                   interval=0.2, message="the elastic restart resumes from the checkpoint")  # fmt: skip
        after = [workers_of(p.pid) for p in nodes]  # the workers of the new rendezvous round
        for g in groups[6:]:  # phase 2: the rest
            assert Groups(buf).put([g]) == [True]
        for i, p in enumerate(nodes, start=1):
            assert p.wait(150) == 0, f"node {i}: {logs[i - 1].read_text()[-3000:]}"
        left = [_ns_pids(name) for name in hosts.ns]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        redis_numbers = stats(buf)
        redis.stop()

    # both agents replaced their worker: node 2's died, node 1's left the broken group
    assert [len(w) for w in after] == [1, 1] and set(after[0] + after[1]).isdisjoint(before[0] + before[1])
    assert left == [[], []]  # both hosts finished: no agent or worker left running on either
    log1, log2 = (log.read_text() for log in logs)
    found = [e for e in events() if e["event"] == "resume"]
    # first start, then the restart: it forked at the v=2 checkpoint and reclaimed g04, g05
    assert [(e["version"], e["epoch"], e["reclaimed"]) for e in found] == [(0, 0, 0), (2, 1, 2)], (
        found, log1[-2000:], log2[-2000:])  # fmt: skip
    lineage: dict[int, dict] = {}
    for e in events():  # a version's last step entry wins (the restart redid v=3)
        if e["event"] == "step":
            lineage[e["version"]] = e
    assert sorted(lineage) == list(range(1, STEPS + 1))
    trained = [gid for v in sorted(lineage) for gid in lineage[v]["groups"]]
    assert sorted(trained) == [g.group_id for g in groups]  # each group once in the surviving lineage
    acked = sum(e["acked"] for e in events() if e["event"] == "checkpoint")
    assert acked == len(groups)  # v=2 by the first run (g00-g03); v=4, 6, 8 by the restarted one
    assert redis_numbers["counters"].get("trained") == len(groups)  # acked exactly once each
    assert redis_numbers["pending"]["groups"] == 0 and redis_numbers["depth"]["groups"] == 0
    # the checkpoints both hosts wrote into the shared directory: one shard file per rank
    final = out / "checkpoints" / f"step_{STEPS:08d}"
    assert {p.name for p in final.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert json.loads((final / "meta.json").read_text())["world"] == 2


@pytest.mark.timeout(480)
def test_demo_topology_trains_on_two_hosts_through_a_killed_rank(tmp_path, hosts):
    """The demo topology's engine, reward and rollout services (`asyncrl up` without its trainer,
    in the root namespace) feed a trainer on the two hosts; node 2's rank is SIGKILLed after
    step 3. Live data, so the split at the kill is not scripted: the accounting is checked
    against the audit log, the buffer's states and its counters."""
    import tomllib

    import tomli_w

    from asyncrl.buffer.server import free_port
    from asyncrl.services.ops.demo_jobs import submit
    from asyncrl.services.ops.launcher import Launcher
    from asyncrl.services.ops.run_config import DemoSection, RunConfig

    steps, batch = 6, 8
    shared = tmp_path / "shared"
    password = uuid.uuid4().hex
    redis = RedisServer(tmp_path / "redis", bind=(hosts.redis_addr,), password=password).start()
    url = f"redis://:{password}@{hosts.redis_addr}:{redis.port}/0"
    raw = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    raw["run"].update(id="nodes", dir=str(shared / "run"), redis_url=url)
    raw["model"]["path"] = str(shared / "run" / "base")
    raw["launch"].update(engine_port=free_port(), reward_port=free_port(), rollout_port=free_port(),
                         trainer=False, metrics_port=free_port(), health_timeout_s=120)  # fmt: skip
    raw["trainer"].update(max_steps=steps, batch_groups=batch, checkpoint_every=CHECKPOINT_EVERY,
                          heartbeat_s=0.3, block_ms=200, device="cpu")  # fmt: skip
    raw["demo"].update(prompts_per_step=batch)
    config = shared / "config.toml"
    shared.mkdir()
    config.write_text(tomli_w.dumps(raw))
    launcher = Launcher(RunConfig.model_validate(raw), config, echo=False)
    out = shared / "run" / "trainer"  # where the launcher's engines take weights from
    audit = out / "trained.jsonl"
    logs = [tmp_path / f"node{i}.log" for i in (1, 2)]
    # what the launcher passes its own trainer, here to each host's
    extra = (
        "--redis-url",
        url,
        "--run",
        "nodes",
        "--model-path",
        raw["model"]["path"],
        "--output-dir",
        str(out),
    )
    nodes: list[subprocess.Popen] = []

    def events() -> list[dict]:
        return read_audit(audit) if audit.exists() else []

    def alive() -> None:
        for i, p in enumerate(nodes, start=1):
            assert p.poll() is None, f"node {i} exited ({p.returncode}): {logs[i - 1].read_text()[-3000:]}"

    try:
        launcher.start()
        demo = DemoSection.model_validate(raw["demo"])
        submit(launcher.rollout_urls()[0], demo, (steps + 6) * batch, random.Random(0))
        nodes = [start_node(hosts, i, config, logs[i - 1], "nodes-demo", *extra) for i in (1, 2)]
        wait_until(lambda: alive() or any(e["event"] == "step" and e["version"] >= 3 for e in events()),
                   timeout=200, interval=0.2, message="step 3 on two hosts")  # fmt: skip
        victims = workers_of(nodes[1].pid)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        for i, p in enumerate(nodes, start=1):
            assert p.wait(200) == 0, f"node {i}: {logs[i - 1].read_text()[-3000:]}"
        left = [_ns_pids(name) for name in hosts.ns]
        buf = Buffer(redis.url, "nodes")
        numbers = stats(buf)
        states = {k.decode(): v.decode() for k, v in buf.redis.hgetall(buf.keys.group_state).items()}
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        launcher.stop()
        redis.stop()

    assert left == [[], []]
    log = read_audit(audit)
    resumes = [(e["version"], e["epoch"]) for e in log if e["event"] == "resume"]
    restart = next(i for i, e in enumerate(log) if e["event"] == "resume" and e["version"] > 0)
    before = log[:restart]
    audited = max(e["version"] for e in before if e["event"] == "checkpoint")
    resumed = log[restart]["version"]
    # the restart resumed from the last durable checkpoint: the last one audited, or the next one
    # if the kill fell between its rename and its audit line (the resume then finishes its ack)
    assert resumes == [(0, 0), (resumed, 1)] and resumed in (audited, audited + CHECKPOINT_EVERY)
    lost_steps = [e for e in before if e["event"] == "step" and e["version"] > resumed]
    redone = {g for e in lost_steps for g in e["groups"]}  # trained, never checkpointed: redelivered
    assert log[restart]["reclaimed"] >= len(redone)  # (the kill's timing against the steps is live)
    lineage: dict[int, dict] = {}
    for e in log:
        if e["event"] == "step":
            lineage[e["version"]] = e
    assert sorted(lineage) == list(range(1, steps + 1))
    trained = [g for v in sorted(lineage) for g in lineage[v]["groups"]]
    assert len(trained) == len(set(trained)) == steps * batch  # each group once in the surviving lineage
    exits = {g for e in log if e["event"] == "step" for key in ("dropped", "lost") for g in e[key]}
    assert redone <= set(trained) | exits  # the killed run's unacked groups were trained again or dropped
    assert numbers["counters"].get("trained") == len(trained)  # acked exactly once each
    assert sorted(g for g, state in states.items() if state == "trained") == sorted(trained)
    for outcome in ("dropped", "lost"):  # each drop the steps report is one buffer state, one count
        ids = {g for e in log if e["event"] == "step" for g in e[outcome]}
        assert {g for g, state in states.items() if state == outcome} == ids
        assert numbers["counters"].get(outcome, 0) == len(ids)
    assert numbers["pending"]["groups"] == 0
