"""Replay buffer against a real redis-server: delivery, staleness, admission, dead letters,
crash recovery and AOF durability."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

import buffer_workers as workers
import msgspec
import numpy as np
import pytest
from factories import edit_sample, make_group, make_job
from prometheus_client import REGISTRY
from waiting import wait_until

from asyncrl.buffer import (
    AdmissionControl,
    Buffer,
    GroupReport,
    Groups,
    Jobs,
    PolicyVersions,
    RedisServer,
    stats,
)
from asyncrl.proto import SCHEMA_VERSION, encode
from asyncrl.proto.states import Admission, GroupState

SPAWN = mp.get_context("spawn")


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@dataclass
class Parts:
    """One process's buffer: the connection and every part on it."""

    conn: Buffer
    groups: Groups
    jobs: Jobs
    admission: AdmissionControl
    weights: PolicyVersions

    def stats(self) -> dict:
        return stats(self.conn)


def open_parts(
    url: str, run: str, consumer: str = "trainer-0", batch_groups: int = 1, max_staleness: int = 0
) -> Parts:
    conn = Buffer(url, run)
    return Parts(conn, Groups(conn, consumer), Jobs(conn, consumer), AdmissionControl(conn, batch_groups, max_staleness),
                 PolicyVersions(conn))  # fmt: skip


def all_delivered(buf: Parts) -> bool:
    """The trainer group has handed every entry added so far to a consumer."""
    r, stream = buf.conn.redis, buf.conn.keys.groups
    (group,) = r.xinfo_groups(stream)
    return group["last-delivered-id"] == r.xinfo_stream(stream)["last-generated-id"]


@pytest.fixture
def buf(redis_url, run_id):
    b = open_parts(redis_url, run_id, batch_groups=4, max_staleness=1)
    yield b
    b.conn.close()


def test_put_is_idempotent_on_group_id(buf):
    g = make_group("g1")
    dup_before = metric("asyncrl_buffer_duplicate_puts_total")
    assert buf.groups.put([g]) == [True]
    assert buf.groups.put([g]) == [False]
    assert buf.groups.put([make_group("g1", seed=9)]) == [
        False
    ]  # same id, other content: still the first one
    res = buf.groups.take(10, current_version=0, block_ms=50)
    assert [x.group_id for x in res.groups] == ["g1"]
    assert res.groups[0] == g
    assert buf.admission.snapshot()["accepted"] == 1
    assert buf.stats()["counters"]["duplicates"] == 2
    assert metric("asyncrl_buffer_duplicate_puts_total") - dup_before == 2
    buf.groups.ack(["g1"])
    assert buf.groups.put([g]) == [False]  # still idempotent after it was trained


def test_batched_put_and_ack_of_many_groups_stay_exact(buf):
    """put_groups and ack work in slices inside their scripts (Lua's unpack limit): 2,100 groups
    in one call each, with duplicates inside the batch, leave exact counters and no payload."""
    groups = [make_group(f"m{i}", job_id=f"job{i % 3}", n=2, n_tokens=1) for i in range(2100)]
    buf.jobs.describe("job1", groups=700, body_hash="")
    flags = buf.groups.put(groups + groups[:5])
    assert flags == [True] * 2100 + [False] * 5
    taken = []
    while len(taken) < 2100:
        taken += buf.groups.take(1000, current_version=0, block_ms=200).groups
    assert sorted(g.group_id for g in taken) == sorted(g.group_id for g in groups)
    assert buf.groups.ack([g.group_id for g in taken] + ["m0"]) == 2100  # m0 twice: counted once
    stats = buf.stats()
    assert stats["depth"]["groups"] == 0 and stats["pending"]["groups"] == 0
    assert stats["counters"]["trained"] == 2100 and stats["counters"]["duplicates"] == 5
    assert buf.admission.snapshot()["accepted"] == 2100  # trained groups keep their admission count
    assert buf.jobs.progress("job1").exits == {GroupState.trained: 700}
    assert not list(buf.conn.redis.scan_iter(buf.conn.keys.payload_prefix + "*"))


def test_pipelined_scripts_survive_a_flushed_script_cache(buf):
    """Pipelines call scripts by sha without checking first; a Redis that lost its scripts (a
    restart) gets them loaded again and the idempotent writes run again, once."""
    assert buf.groups.put([make_group("a")]) == [True]
    buf.conn.redis.script_flush()
    assert buf.groups.put([make_group("b"), make_group("a")]) == [True, False]
    buf.conn.redis.script_flush()
    assert buf.jobs.enqueue([make_job("j1"), make_job("j2")]) == 2
    assert buf.admission.snapshot()["accepted"] == 2 and buf.stats()["counters"]["put"] == 2
    assert [g.group_id for g in buf.groups.take(5, current_version=0, block_ms=50).groups] == ["a", "b"]


def test_parts_of_one_pipeline_get_their_own_replies(buf):
    """The rollout's write of a batch: its groups put, their jobs ended and the version read in
    one round trip, each part's result made from its own replies, also when a flushed script
    cache makes the pipeline run again."""
    buf.jobs.describe("j0", 3, "hash")
    buf.jobs.enqueue([make_job(f"g{i}") for i in range(3)])
    assert len(buf.jobs.claim(3, block_ms=50)) == 3
    buf.weights.set_version(7)
    assert buf.groups.put([make_group("g0")]) == [True]
    buf.conn.redis.script_flush()
    ends = [GroupReport("j0", "g0", GroupState.buffered), GroupReport("j0", "g1", GroupState.buffered, error="late"),
            GroupReport("j0", "g0", GroupState.buffered)]  # fmt: skip
    new, ended, version = buf.conn.pipeline_parts(
        buf.groups.put_part([make_group("g0"), make_group("g1")]),
        buf.jobs.end_part(ends),
        buf.weights.version_part(),
    )
    assert (new, ended, version) == ([False, True], [True, True, False], 7)
    progress = buf.jobs.progress("j0")
    assert progress.states == {"g0": GroupState.buffered, "g1": GroupState.buffered}
    assert progress.errors == {"g1": "late"}
    assert buf.stats()["counters"]["put"] == 2 and buf.stats()["counters"]["duplicates"] == 1
    assert buf.conn.pipeline_parts() == []


def test_put_refuses_unscored_groups(buf):
    g = edit_sample(make_group("g1"), 0, reward_status=None, reward=None)
    with pytest.raises(ValueError, match="without a reward status"):
        buf.groups.put([g])


def test_two_concurrent_consumers_never_receive_the_same_group(redis_url, run_id, tmp_path):
    producer = open_parts(redis_url, run_id, consumer="producer")
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [
        SPAWN.Process(target=workers.consume, args=(redis_url, run_id, f"c{i}", str(out), 3, 2.0))
        for i, out in enumerate(outs)
    ]
    for p in procs:
        p.start()
    wait_until(lambda: len(producer.conn.redis.xinfo_consumers(producer.conn.keys.groups, "trainer")) == 2,
               message="both consumers are reading")  # fmt: skip
    ids = [f"g{i}" for i in range(120)]
    for gid in ids:
        producer.groups.put([make_group(gid, n=2, n_tokens=3)])
        # Delivered before the next put: the consumer waiting longest gets each one, so both get work.
        wait_until(lambda: all_delivered(producer), interval=0.002, message=f"{gid} is delivered")
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    a, b = (json.loads(o.read_text()) for o in outs)
    assert not set(a) & set(b), "a group was delivered to both consumers"
    assert sorted(a + b) == sorted(ids) and len(a) + len(b) == len(ids)
    assert a and b, "both consumers should have received work"
    assert producer.stats()["depth"]["groups"] == 0


def test_consumer_killed_mid_batch_loses_nothing(redis_url, run_id, tmp_path):
    buf = open_parts(redis_url, run_id, consumer="survivor")
    for i in range(10):
        buf.groups.put([make_group(f"g{i}", n=2)])
    out = tmp_path / "taken.json"
    victim = SPAWN.Process(target=workers.take_and_hang, args=(redis_url, run_id, "victim", str(out), 6))
    victim.start()
    wait_until(lambda: out.exists() and out.read_text().endswith("]"), message="the victim took its groups")
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    taken_by_victim = json.loads(out.read_text())
    assert len(taken_by_victim) == 6

    # The survivor sees only the 4 never-delivered groups until it recovers the victim's.
    first = buf.groups.take(10, current_version=0, max_staleness=0, block_ms=50)
    assert sorted(g.group_id for g in first.groups) == sorted(
        {f"g{i}" for i in range(10)} - set(taken_by_victim)
    )
    assert buf.groups.recover(idle_ms=10_000) == 0  # not idle long enough yet
    time.sleep(0.2)  # time is the subject: the victim's entries must sit idle for longer than idle_ms
    assert buf.groups.recover(idle_ms=100) == 6
    second = buf.groups.take(10, current_version=0, max_staleness=0, block_ms=50)
    assert sorted(g.group_id for g in second.groups) == sorted(taken_by_victim)
    assert buf.groups.ack([g.group_id for g in first.groups + second.groups]) == 10
    stats = buf.stats()
    assert stats["pending"]["groups"] == 0 and stats["depth"]["groups"] == 0
    assert stats["counters"]["trained"] == 10


def test_staleness_drop_and_withhold_are_counted(buf):
    # Hand-built versions: min_version of each group, trainer at version 5, eta = 2.
    versions = {"a": 5, "b": 4, "c": 3, "d": 2, "e": 1, "f": 3}
    for gid, v in versions.items():
        g = make_group(gid, n=2, version=v)
        if gid == "f":  # one old token makes the whole group as old as it
            g = edit_sample(g, 0, versions=np.array([1, *g.samples[0].versions[1:]], np.int32))
        buf.groups.put([g])
    dropped_before = metric("asyncrl_buffer_dropped_total", reason="stale")
    res = buf.groups.take(3, current_version=5, max_staleness=2, block_ms=50, policy="drop")
    # a (0), b (1), c (2) are fresh; take stops after 3 fresh groups.
    assert [g.group_id for g in res.groups] == ["a", "b", "c"] and res.staleness == [0, 1, 2]
    res = buf.groups.take(3, current_version=5, max_staleness=2, block_ms=50, policy="withhold")
    # d (3), e (4), f (4) are all too stale: withheld, none trainable.
    assert res.groups == [] and [g.group_id for g in res.withheld] == ["d", "e", "f"]
    stats = buf.stats()
    assert stats["counters"]["withheld"] == 3 and "dropped" not in stats["counters"]
    assert stats["staleness"]["histogram"] == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2}
    assert stats["depth"]["stale"] == 3

    for gid, v in (("g", 0), ("h", 4)):
        buf.groups.put([make_group(gid, n=2, version=v)])
    res = buf.groups.take(2, current_version=5, max_staleness=2, block_ms=50, policy="drop")
    assert [g.group_id for g in res.groups] == ["h"] and res.dropped == ["g"]
    assert metric("asyncrl_buffer_dropped_total", reason="stale") - dropped_before == 1
    # Stale groups give their admission slot back; the trained one (h, once acked) keeps it.
    assert buf.admission.snapshot()["accepted"] == 8 - 4
    assert buf.groups.ack(["a", "b", "c", "h"]) == 4
    assert buf.admission.snapshot()["accepted"] == 4


def test_discard_is_counted_once_and_frees_the_slot(buf):
    for gid in ("a", "b"):
        buf.groups.put([make_group(gid)])
    buf.groups.take(2, current_version=0, block_ms=50)
    assert buf.groups.discard(["a"], GroupState.zero_spread) == 1
    assert buf.groups.discard(["a"], GroupState.zero_spread) == 0
    assert buf.groups.ack(["a"]) == 0  # already gone: not trained
    assert buf.admission.snapshot()["accepted"] == 1
    assert buf.stats()["counters"]["zero_spread"] == 1
    with pytest.raises(ValueError):
        buf.groups.discard(["b"], GroupState.trained)


def test_admission_bound_holds_across_8_concurrent_processes(redis_url, run_id, tmp_path):
    buf = open_parts(redis_url, run_id, consumer="cfg")
    buf.admission.configure(batch_groups=4, max_staleness=2)
    buf.weights.set_version(3)
    buf.groups.put([make_group("already-there")])  # accepted = 1
    capacity = (2 + 3 + 1) * 4  # (η + v + 1)·B = 24
    start = SPAWN.Barrier(8 + 1)  # every worker connected, then all released together
    outs = [tmp_path / f"w{i}.json" for i in range(8)]
    procs = [
        SPAWN.Process(target=workers.admit, args=(redis_url, run_id, i, 10, start, str(outs[i])))
        for i in range(8)
    ]
    for p in procs:
        p.start()
    start.wait(timeout=60)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    admitted = [gid for out in outs for gid in json.loads(out.read_text())]
    assert len(admitted) == capacity - 1, "accepted + running must stop exactly at (η+v+1)·B"
    assert len(set(admitted)) == len(admitted)
    adm = buf.admission.snapshot()
    assert adm["running"] == capacity - 1 and adm["accepted"] + adm["running"] == capacity
    assert buf.admission.try_admit("late") is Admission.full
    # A reclaimed job re-admits its own group without taking a second slot.
    assert buf.admission.try_admit(admitted[0]) is Admission.resumed
    # Putting a running group moves its slot from running to accepted; the bound is unchanged.
    buf.groups.put([make_group(admitted[0])])
    adm = buf.admission.snapshot()
    assert (adm["accepted"], adm["running"]) == (2, capacity - 2)
    assert buf.admission.try_admit(admitted[0]) is Admission.duplicate
    # The trainer steps: one more version frees B slots.
    buf.weights.set_version(4)
    assert sum(buf.admission.try_admit(f"after-{i}").go for i in range(10)) == 4
    assert buf.admission.release(admitted[1]) and not buf.admission.release(admitted[1])
    assert buf.admission.try_admit("after-release").go


def test_a_queue_of_groups_is_admitted_in_one_call_first_come_first_served(buf):
    """`try_admit_many` answers each group as `try_admit` would in turn, and the first `full`
    answers every group behind it `full`, even one a freed slot would fit: no overtaking."""
    buf.admission.configure(batch_groups=1, max_staleness=0)  # capacity (0 + 0 + 1) * 1 = 1
    buf.groups.put([make_group("put-before")])  # accepted = 1: no slot left
    assert buf.admission.try_admit("held") is Admission.full
    buf.admission.configure(batch_groups=3, max_staleness=0)  # capacity 3: two slots left
    assert buf.admission.try_admit("held") is Admission.admitted
    answers = buf.admission.try_admit_many(["held", "put-before", "a", "b", "held", "put-before"])
    assert answers == [Admission.resumed, Admission.duplicate, Admission.admitted, Admission.full,
                       Admission.full, Admission.full]  # fmt: skip
    assert buf.admission.snapshot()["running"] == 2  # held, a
    assert buf.admission.release("a")
    assert buf.admission.try_admit_many(["b", "c"]) == [Admission.admitted, Admission.full]
    assert buf.admission.try_admit_many([]) == []


def test_jobs_end_together_in_one_call(redis_url, run_id):
    jobs = Jobs(Buffer(redis_url, run_id), "rollout-a")
    jobs.describe("j0", 3, "hash")
    jobs.enqueue([make_job(f"g{i}") for i in range(3)])
    claimed = jobs.claim(3, block_ms=50)
    assert len(claimed) == 3
    ends = [GroupReport("j0", "g0", GroupState.buffered), GroupReport("j0", "g1", GroupState.failed, error="boom"),
            GroupReport("j0", "g0", GroupState.buffered)]  # fmt: skip
    assert jobs.end_many(ends) == [True, True, False]  # the repeated g0 found its job ended
    assert jobs.end_many([]) == []
    progress = jobs.progress("j0")
    assert progress.states == {"g0": GroupState.buffered, "g1": GroupState.failed}
    assert progress.errors == {"g1": "boom"}
    assert stats(jobs.buf)["pending"]["jobs"] == 1  # g2 only
    with pytest.raises(ValueError):
        jobs.end_many([GroupReport("j0", "g2", GroupState.scoring)])


def test_rebuild_admission_after_trainer_restart(buf):
    buf.admission.configure(batch_groups=2, max_staleness=1)
    for i in range(6):
        buf.groups.put([make_group(f"g{i}")])
    res = buf.groups.take(2, current_version=0, max_staleness=1, block_ms=50)
    buf.groups.ack([g.group_id for g in res.groups])  # trained at step 1
    assert (
        len(buf.groups.take(2, current_version=1, max_staleness=1, block_ms=50).groups) == 2
    )  # step 2, then a crash
    # The checkpoint is at version 1: v·B trained + 4 still in the buffer (2 pending, 2 new).
    assert buf.admission.rebuild(1) == 1 * 2 + 4
    assert buf.weights.version() == 1
    assert buf.admission.snapshot()["capacity"] == (1 + 1 + 1) * 2  # (η + v + 1)·B


def test_bad_payloads_go_to_dead_letter_and_good_ones_keep_flowing(buf):
    r, keys = buf.conn.redis, buf.conn.keys
    good_bytes = encode(make_group("x"))
    bad = {
        "truncated": good_bytes[:-7],
        "garbage": b"\x93\x01\xff\x00not msgpack",
        "wrong-type": msgspec.msgpack.encode([SCHEMA_VERSION, {"type": "group", "group_id": 5}]),
        "future-schema": msgspec.msgpack.encode([99, {"type": "group"}]),
        "job-in-groups": encode(make_job()),
    }
    dead_before = metric("asyncrl_buffer_dead_lettered_total", stream="groups")
    for i, (name, payload) in enumerate(bad.items()):
        buf.groups.put([make_group(f"good{i}")])
        r.set(keys.payload_prefix + name, payload)
        r.xadd(keys.groups, {"gid": name})
    r.xadd(keys.groups, {"gid": "no-data"})
    buf.groups.put([make_group("good-last")])
    res = buf.groups.take(100, current_version=0, block_ms=100)
    assert [g.group_id for g in res.groups] == [f"good{i}" for i in range(5)] + ["good-last"]
    assert res.dead_lettered == 6
    letters = r.xrange(keys.deadletter)
    reasons = {f[b"gid"].decode(): f[b"reason"].decode() for _, f in letters}
    assert set(reasons) == set(bad) | {"no-data"}
    assert "unknown schema 99" in reasons["future-schema"]
    assert "expected a group record" in reasons["job-in-groups"]
    assert "payload is missing" in reasons["no-data"]
    assert {f[b"data"] for _, f in letters if f[b"gid"] == b"garbage"} == {bad["garbage"]}
    assert metric("asyncrl_buffer_dead_lettered_total", stream="groups") - dead_before == 6
    stats = buf.stats()
    assert stats["pending"]["groups"] == 6  # the good ones, awaiting ack; no bad one is pending
    assert stats["counters"]["dead_lettered"] == 6 and stats["admission"]["accepted"] == 6


def test_jobs_stream_claim_ack_and_recovery(redis_url, run_id):
    a = Jobs(Buffer(redis_url, run_id), "rollout-a")
    b = Jobs(Buffer(redis_url, run_id), "rollout-b")
    jobs = [make_job(f"g{i}") for i in range(5)]
    assert [a.enqueue([j]) for j in jobs] == [1] * 5
    assert a.enqueue([jobs[0]]) == 0
    a.buf.redis.xadd(a.keys.jobs, {"gid": "junk", "data": b"\x00\x01"})
    got_a = a.claim(3, block_ms=50)
    assert [c.job for c in got_a] == jobs[:3]
    got_b = b.claim(10, block_ms=50)
    assert [c.job.group_id for c in got_b] == ["g3", "g4"]  # junk went to the dead-letter stream
    assert stats(a.buf)["counters"]["dead_lettered"] == 1
    done = GroupReport("j0", "g0", GroupState.buffered)
    assert a.end(done) is True and a.end(done) is False
    time.sleep(0.3)  # time is the subject: a's claims must sit idle for longer than idle_ms
    a.touch([got_a[1].entry_id])  # a is alive and still working on g1
    # b takes over a's idle g2; its own g3, g4 are in hand and not handed out again; g0 is done.
    assert [c.job.group_id for c in b.recover(idle_ms=200)] == ["g2"]
    assert [c.job.group_id for c in a.recover(idle_ms=200)] == []
    fresh_b = Jobs(Buffer(redis_url, run_id), "rollout-b")  # b restarted: it resumes its own
    assert sorted(c.job.group_id for c in fresh_b.resume_own()) == ["g2", "g3", "g4"]
    assert fresh_b.resume_own() == []  # now held


def test_weights_publish_and_subscribe(buf):
    from asyncrl.proto import WeightsInfo

    weights, r = buf.weights, buf.conn.redis
    assert weights.latest() is None
    with weights.subscribe() as sub:
        channel = buf.conn.keys.weights_channel
        wait_until(lambda: r.pubsub_numsub(channel)[0][1] == 1, message="the subscription is live")
        weights.publish(WeightsInfo(version=1, method="disk", path="/w/1", published_at=1.0))
        weights.publish(WeightsInfo(version=2, method="distributed"))
        assert sub.get(2.0).version == 1
        assert sub.get(2.0).method == "distributed"
        assert sub.get(0.1) is None
    weights.publish(WeightsInfo(version=0, method="disk", path="/w/0"))  # late, older: not "latest"
    assert weights.latest().version == 2
    for v in range(3, 40):
        weights.publish(WeightsInfo(version=v, method="disk", path=f"/w/{v}"))
    assert sorted(int(v) for v in r.hkeys(buf.conn.keys.weights)) == list(range(24, 40))  # the last 16
    # A trainer resumed from the checkpoint at 30: 31..39 never happened.
    weights.publish(WeightsInfo(version=30, method="disk", path="/w/30b"), rollback=True)
    assert weights.latest().path == "/w/30b"
    assert max(int(v) for v in r.hkeys(buf.conn.keys.weights)) == 30


@pytest.mark.parametrize("crash", [False, True], ids=["clean-restart-everysec", "sigkill-fsync-always"])
def test_redis_restart_with_aof_loses_no_acknowledged_put(tmp_path, crash):
    server = RedisServer(tmp_path / "redis", fsync="always" if crash else "everysec").start()
    buf = open_parts(server.url, "aof", consumer="t")
    acknowledged = [f"g{i}" for i in range(50) if buf.groups.put([make_group(f"g{i}", n=2)])[0]]
    taken = buf.groups.take(10, current_version=0, block_ms=50)
    buf.groups.ack([g.group_id for g in taken.groups[:5]])
    buf.conn.close()
    server.kill() if crash else server.stop()
    server = RedisServer(tmp_path / "redis", port=server.port, fsync="always").start()
    try:
        buf = open_parts(server.url, "aof", consumer="t")
        assert buf.stats()["counters"]["trained"] == 5
        assert buf.groups.recover(0) == 5  # taken but unacked before the restart
        res = buf.groups.take(100, current_version=0, block_ms=50)
        assert len(acknowledged) == 50
        assert sorted(g.group_id for g in res.groups) == sorted(acknowledged[5:])
        assert buf.admission.snapshot()["accepted"] == 50
        buf.conn.close()
    finally:
        server.stop()


def test_a_fresh_trainer_waits_for_its_prefill_then_trains_the_oldest_first(buf):
    """`prefill_groups`: the first step of a fresh run (version 0) starts only once the buffer
    holds that many groups, and takes the oldest B of them; a resumed run (version > 0) never
    waits for it. A real GroupSource on a world of one, the groups put from another thread."""
    import threading

    import torch

    from asyncrl.trainer.data import GroupSource
    from asyncrl.trainer.model import Dist

    d = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    source = GroupSource(d, buf.groups, batch_groups=2, max_staleness=1, policy="drop", block_ms=50,
                         dynamic_sampling=False, shaping=None, heartbeat_s=0.2, prefill=5)  # fmt: skip
    put_at: dict[str, float] = {}

    def producer() -> None:
        for i in range(5):
            time.sleep(0.15)  # time is the subject: the source must not start before the 5th put
            put_at[f"p{i}"] = time.monotonic()
            buf.groups.put([make_group(f"p{i}")])

    thread = threading.Thread(target=producer)
    thread.start()
    taken = source.next(0)
    returned = time.monotonic()
    thread.join()
    assert returned >= put_at["p4"]  # two p's were there long before: it waited for all five
    assert [g.group_id for g in taken.groups] == ["p0", "p1"] and source.heartbeats >= 1
    assert [g.group_id for g in source.next(0).groups] == ["p2", "p3"]  # waited once: now it takes at once
    assert buf.groups.depth() == 5  # nothing acknowledged yet: every entry still in the stream

    resumed = GroupSource(d, buf.groups, batch_groups=1, max_staleness=1, policy="drop", block_ms=50,
                          dynamic_sampling=False, shaping=None, heartbeat_s=0.2, prefill=50)  # fmt: skip
    assert [g.group_id for g in resumed.next(1).groups] == ["p4"]  # a resumed run: no prefill to wait for


def test_prefill_past_what_admission_lets_wait_is_refused():
    from asyncrl.trainer.config import TrainerSettings

    TrainerSettings(model_path="m", batch_groups=4, max_staleness=2, prefill_groups=12)
    with pytest.raises(ValueError, match="admission never lets that many wait"):
        TrainerSettings(model_path="m", batch_groups=4, max_staleness=2, prefill_groups=13)
