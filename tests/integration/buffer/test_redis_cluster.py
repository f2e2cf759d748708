"""The replay buffer on a real Redis Cluster: 3 masters + 3 replicas (`redis-server
--cluster-enabled yes`, AOF with `appendfsync always`) started by the test on free ports.
Put, take, ack and admission stay exact as on one node; payloads spread over the masters; a
master killed mid-run (SIGKILL) and failed over to its replica loses no acked group and trains
none twice. The cluster is buffer/local_cluster.py."""

from __future__ import annotations

import threading
import uuid

import pytest
from factories import make_group
from prometheus_client import REGISTRY
from waiting import wait_until

from asyncrl.buffer import AdmissionControl, Buffer, Groups, stats
from asyncrl.buffer.connection import ClusterURL
from asyncrl.buffer.groups import EXIT
from asyncrl.buffer.local_cluster import LocalCluster
from asyncrl.proto.states import Admission, GroupState


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def run_id() -> str:
    return f"c{uuid.uuid4().hex[:10]}"


def test_the_url_names_the_startup_nodes_and_the_replica_wait():
    url = ClusterURL("redis+cluster://10.0.0.1:7000,10.0.0.2:7001?replicas=2&wait_ms=250")
    assert [(n.host, n.port) for n in url.nodes] == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert (url.replicas, url.wait_ms) == (2, 250)
    assert (ClusterURL("redis+cluster://h:1").replicas, ClusterURL("redis+cluster://h:1").wait_ms) == (
        1,
        1000,
    )
    for bad in ("redis+cluster://h", "redis+cluster://h:1?replica=1", "redis+cluster://h:x", "redis://h:1"):
        with pytest.raises(ValueError):
            ClusterURL(bad)


def test_put_take_ack_are_exact_and_payloads_spread_over_masters(cluster, run_id):
    buf = Buffer(cluster.url, run_id)
    groups = Groups(buf, "trainer-0")
    batch = [make_group(f"m{i}", job_id=f"job{i % 3}", n=2, n_tokens=1) for i in range(300)]
    assert groups.put(batch + batch[:5]) == [True] * 300 + [False] * 5
    assert groups.put([make_group("m7", seed=9)]) == [False]  # same id, other content: the first stays

    # The metadata is in one slot; the payloads on every master (each holds ~1/3 of the slots).
    meta_owner = cluster.owner(buf.keys.group_state)
    assert all(
        cluster.owner(getattr(buf.keys, k)) == meta_owner for k in ("groups", "admission", "stats", "jobs")
    )
    per_master = {p: cluster.owner(buf.payload_key(g.group_id)) for p, g in enumerate(batch)}
    counts = {m: list(per_master.values()).count(m) for m in cluster.masters()}
    assert len(counts) == 3 and all(c >= 50 for c in counts.values()), counts
    assert sum(len(list(cluster.node(m).scan_iter(buf.payload_key("*")))) for m in counts) == 300

    taken = []
    while len(taken) < 300:
        taken += groups.take(120, current_version=0, block_ms=300).groups
    assert sorted(g.group_id for g in taken) == sorted(g.group_id for g in batch)
    assert {g.group_id: g for g in taken}["m7"] == batch[7]  # the payload read back is the one put
    assert groups.ack([g.group_id for g in taken] + ["m0"]) == 300  # m0 twice: counted once
    numbers = stats(buf)
    assert numbers["depth"]["groups"] == 0 and numbers["pending"]["groups"] == 0
    assert numbers["counters"]["trained"] == 300 and numbers["counters"]["duplicates"] == 6
    assert numbers["admission"]["accepted"] == 300
    assert sum(len(list(cluster.node(m).scan_iter(buf.payload_key("*")))) for m in counts) == 0
    assert groups.put([batch[0]]) == [False]  # still idempotent after it was trained, payload not kept
    assert not cluster.node(cluster.owner(buf.payload_key("m0"))).exists(buf.payload_key("m0"))
    buf.close()


def test_two_consumers_on_the_cluster_never_receive_the_same_group(cluster, run_id):
    Groups(Buffer(cluster.url, run_id)).put([make_group(f"g{i}", n=2, n_tokens=1) for i in range(200)])
    got: dict[str, list[str]] = {"a": [], "b": []}

    def consume(name: str) -> None:
        groups = Groups(Buffer(cluster.url, run_id), name)
        while True:
            res = groups.take(7, current_version=0, block_ms=300)
            if not res.groups:
                return
            got[name] += [g.group_id for g in res.groups]
            groups.ack([g.group_id for g in res.groups])

    threads = [threading.Thread(target=consume, args=(n,)) for n in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not set(got["a"]) & set(got["b"])
    assert sorted(got["a"] + got["b"]) == sorted(f"g{i}" for i in range(200))
    assert got["a"] and got["b"]
    assert stats(Buffer(cluster.url, run_id))["counters"]["trained"] == 200


def test_admission_is_exact_on_the_cluster(cluster, run_id):
    buf = Buffer(cluster.url, run_id)
    admission, groups = AdmissionControl(buf, batch_groups=1, max_staleness=0), Groups(buf, "t")
    groups.put([make_group("put-before")])  # accepted = 1: no slot left
    assert admission.try_admit("held") is Admission.full
    admission.configure(batch_groups=3, max_staleness=0)
    assert admission.try_admit("held") is Admission.admitted
    answers = admission.try_admit_many(["held", "put-before", "a", "b"])
    assert answers == [Admission.resumed, Admission.duplicate, Admission.admitted, Admission.full]
    assert admission.snapshot()["running"] == 2 and admission.release("a")
    assert groups.put([make_group("held")]) == [True]  # its slot moves from running to accepted
    assert admission.snapshot() == {**admission.snapshot(), "running": 0, "accepted": 2}


def test_a_missing_payload_is_dead_lettered_and_an_orphan_is_swept(cluster, run_id):
    buf = Buffer(cluster.url, run_id)
    groups = Groups(buf, "t")
    groups.put([make_group("ok"), make_group("lost-payload")])
    key = buf.payload_key("lost-payload")
    cluster.node(cluster.owner(key)).delete(key)
    res = groups.take(10, current_version=0, block_ms=200)
    assert [g.group_id for g in res.groups] == ["ok"] and res.dead_lettered == 1
    assert buf.redis.hget(buf.keys.group_state, "lost-payload") == b"dead_lettered"
    # An exit cut off between its script and its UNLINK: the group left, its payload stayed.
    orphan = buf.payload_key("ok")
    cluster.node(cluster.owner(orphan)).set(buf.payload_key("ok"), b"left behind")  # (re-written)
    buf.call(
        EXIT,
        state=buf.keys.group_state, entry=buf.keys.group_entry, job=buf.keys.group_job, groups=buf.keys.groups,
        admission=buf.keys.admission, stats=buf.keys.stats, job_prefix=buf.keys.job_prefix,
        payload_prefix=buf.keys.payload_prefix, stepped=buf.keys.group_stepped, consumer_group="trainer",
        exit=GroupState.trained.value, unlink=0, gids=["ok"],
    )  # fmt: skip
    in_flight = buf.payload_key("not-recorded-yet")  # a put cut off before PUT: a TTL, not swept
    cluster.node(cluster.owner(in_flight)).set(in_flight, b"x", px=60_000)
    assert groups.sweep_payloads() == 1
    assert not cluster.node(cluster.owner(orphan)).exists(orphan)
    assert cluster.node(cluster.owner(in_flight)).exists(in_flight)
    assert stats(buf)["counters"]["trained"] == 1


def test_a_master_killed_mid_run_loses_no_acked_group_and_trains_none_twice(tmp_path, run_id):
    """SIGKILL the master of the run's metadata slot after some acks, with groups delivered and
    not acked: its replica takes over, the same clients carry on (retrying through the
    failover), the trainer's restart path (`recover(0)`) hands the unacked ones out again. Every
    acked group stays trained, none is delivered after its ack, every group is trained once."""
    c = LocalCluster(tmp_path).start()
    try:
        buf = Buffer(c.url, run_id)  # (after the kill, WAIT on the new master times out: no replica)
        groups = Groups(buf, "trainer-0")
        first = [make_group(f"a{i}", n=2, n_tokens=1) for i in range(60)]
        assert groups.put(first) == [True] * 60
        acked: list[str] = []
        while len(acked) < 30:
            ids = [g.group_id for g in groups.take(10, current_version=0, block_ms=300).groups]
            assert groups.ack(ids) == len(ids)
            acked += ids
        in_flight = [g.group_id for g in groups.take(10, current_version=0, block_ms=300).groups]
        assert len(in_flight) == 10

        unreplicated = REGISTRY.get_sample_value("asyncrl_redis_unreplicated_total") or 0.0
        victim = c.owner(buf.keys.group_state)
        c.kill(victim)
        c.wait_ok()
        assert c.owner(buf.keys.group_state) != victim

        # The same clients carry on; the trainer restarts (recover) and a producer puts more.
        assert groups.put([make_group(f"b{i}", n=2, n_tokens=1) for i in range(20)]) == [True] * 20
        assert groups.put(first[:3]) == [False] * 3  # idempotent across the failover too
        groups = Groups(Buffer(c.url, run_id), "trainer-0")  # the trainer restarted
        assert groups.recover(0) == 10
        after: list[str] = []
        while True:
            ids = [g.group_id for g in groups.take(10, current_version=0, block_ms=500).groups]
            if not ids:
                break
            after += ids
            assert groups.ack(ids) == len(ids)
        assert not set(after) & set(acked)  # no acked group delivered again
        assert len(after) == len(set(after)) == 50
        assert sorted(acked + after) == sorted([f"a{i}" for i in range(60)] + [f"b{i}" for i in range(20)])
        states = buf.redis.hgetall(buf.keys.group_state)
        assert {k.decode(): v.decode() for k, v in states.items()} == dict.fromkeys(acked + after, "trained")
        numbers = stats(buf)
        assert numbers["counters"]["trained"] == 80 and numbers["counters"]["duplicates"] == 3
        assert numbers["depth"]["groups"] == 0 and numbers["pending"]["groups"] == 0
        assert buf.retry.outages >= 1  # the failover was ridden out, not missed
        # The promoted master has no replica left: its writes are counted as unconfirmed.
        assert (REGISTRY.get_sample_value("asyncrl_redis_unreplicated_total") or 0.0) > unreplicated
        masters = c.masters()
        assert len(masters) == 3 and victim not in masters
        assert sum(len(list(c.node(m).scan_iter(buf.payload_key("*")))) for m in masters) == 0
    finally:
        c.stop()


def test_jobs_weights_sessions_and_evaluations_work_on_the_cluster(cluster, run_id):
    """Every other part of the buffer keeps its keys in the run's slot: the same calls as on one
    node, through the cluster client (the weights announcement through cluster pub/sub)."""
    from factories import make_job

    from asyncrl.buffer import EvalStore, GroupReport, Jobs, PolicyVersions, SessionStore
    from asyncrl.buffer.gathering import gather, open_holding
    from asyncrl.proto import FinishReason, WeightsInfo
    from asyncrl.proto.evals import EvalPrompt, EvalSummary, EvalTask
    from asyncrl.proto.gateway import Call

    buf = Buffer(cluster.url, run_id)
    jobs = Jobs(buf, "rollout-a")
    assert jobs.enqueue([make_job(f"g{i}") for i in range(4)]) == 4 and jobs.enqueue([make_job("g0")]) == 0
    claimed = jobs.claim(10, block_ms=100)
    assert [c.job.group_id for c in claimed] == ["g0", "g1", "g2", "g3"]
    done = GroupReport("j0", "g0", GroupState.buffered)
    assert jobs.end(done) is True and jobs.end(done) is False

    weights = PolicyVersions(buf)
    with weights.subscribe() as sub:
        channel = buf.keys.weights_channel  # (counted by the one node the subscriber is on)
        wait_until(
            lambda: sum(cluster.node(p).pubsub_numsub(channel)[0][1] for p in cluster.live()) == 1,
            message="the subscription is live",
        )
        weights.publish(WeightsInfo(version=1, method="disk", path="/w/1"), set_version=True)
        got = sub.get(5.0)
        assert (got.version, got.path) == (1, "/w/1")
    assert weights.latest().version == 1 and weights.version() == 1

    sessions = SessionStore(buf, ttl_s=60.0, lease_s=5.0)
    for sid in ("r.t.a", "r.t.b"):
        assert open_holding(sessions, sid) == "ok"
        call = Call.of([1, 2], [10], [-0.5], [3], lineage={}, finish_reason=FinishReason.stop, text="t",
                       started=1.0, finished=2.0)  # fmt: skip
        assert sessions.record(sid, call, 0) == "ok"
    assert gather(sessions, "r.g.k", ["r.t.b", "r.t.a"], 3, "p1") == ["ok"]
    assert [sessions.session(s)["index"] for s in ("r.t.b", "r.t.a")] == ["0", "1"]

    evals = EvalStore(cluster.url, run=run_id)
    summary = EvalSummary(eval_id="e1", name="n", source="api", state="queued", prompts=1, created_at=1.0)
    task = EvalTask(prompts=[EvalPrompt(prompt_id="d0", prompt_tokens=[1, 2], prompt_text="x", reward_spec={"verifier": "reverse"})],
                    sampling_params={})  # fmt: skip
    assert evals.create(summary, task) is True and evals.create(summary, task) is False
    held = evals.claim("runner", 5.0)
    assert (held.summary.eval_id, held.attempts, held.task.prompts[0].prompt_id) == ("e1", 1, "d0")
    assert evals.get("e1")[0].eval_id == "e1" and evals.get("e1")[1] == []
    evals.close()
