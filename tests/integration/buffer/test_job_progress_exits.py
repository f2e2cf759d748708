"""A job's progress (`GET /v1/rollouts/{id}`, computed by the route's `_progress` from the job's
hash in a real Redis) follows its groups through the trainer: `trained` from the optimizer step
that used them (not only once a checkpoint acks them, up to `checkpoint_every` versions later),
`checkpointed` when that checkpoint is durable, and `dead_lettered` for a group whose record did
not decode. A group trained by a step and then redelivered after a crash and dropped is counted
once, as dropped; a replayed step marks nothing twice."""

from __future__ import annotations

from types import SimpleNamespace

from factories import make_group

from asyncrl.buffer import Buffer, Groups, Jobs
from asyncrl.buffer.jobs import GroupReport
from asyncrl.proto.states import GroupState
from asyncrl.services.rollout.routes.rollouts import _progress

JOB = "job-progress"


def progress(jobs: Jobs) -> dict:
    return _progress(SimpleNamespace(jobs=jobs), JOB).model_dump()


def counts(p: dict) -> tuple:
    return p["trained"], p["checkpointed"], p["dropped"], p["dead_lettered"], p["in_buffer"]


def test_trained_from_the_step_durable_at_the_checkpoint_and_dead_letters_shown(redis_url, run_id):
    conn = Buffer(redis_url, run_id)
    groups, jobs = Groups(conn, "trainer-0"), Jobs(conn, "rollout-0")
    ids = [f"g{i}" for i in range(5)]
    jobs.describe(JOB, groups=len(ids), body_hash="h")
    groups.put([make_group(g, job_id=JOB) for g in ids[:2]])
    jobs.report([GroupReport(JOB, g, GroupState.buffered) for g in ids[:2]])
    assert counts(progress(jobs)) == (0, 0, 0, 0, 2)

    taken = groups.take(2, current_version=0, block_ms=100)
    step_1 = [g.group_id for g in taken.groups]
    assert step_1 == ["g0", "g1"]
    assert groups.stepped(step_1, 1) == 2
    assert counts(progress(jobs)) == (2, 0, 0, 0, 0)  # trained at once, not yet durable
    assert groups.stepped(step_1, 1) == 0  # the step replayed after a restart: nothing twice
    assert counts(progress(jobs)) == (2, 0, 0, 0, 0)

    # The checkpoint after step 1 acks g0. Then the trainer crashes before step 1's groups are
    # all durable: g1, pending, is reclaimed by the restarted trainer (as trainer/loop.py does)
    # and taken again at a version that finds it too stale: it leaves as dropped, no longer
    # trained, and is counted once.
    assert groups.ack(["g0"]) == 1
    restarted = Groups(conn, "trainer-0")
    assert restarted.recover(0) == 1
    again = restarted.take(1, current_version=5, max_staleness=0, block_ms=100)
    assert again.groups == [] and again.dropped == ["g1"]
    assert counts(progress(jobs)) == (1, 1, 1, 0, 0)

    # The job's other groups arrive, sampled at version 5.
    groups.put([make_group(g, job_id=JOB, version=5) for g in ids[2:]])
    jobs.report([GroupReport(JOB, g, GroupState.buffered) for g in ids[2:]])
    assert counts(progress(jobs)) == (1, 1, 1, 0, 3)

    # g2's payload is corrupted: taking it dead-letters it, and the job says so.
    conn.redis.set(conn.keys.payload_prefix + "g2", b"\x93\x01\xff not msgpack")
    taken = restarted.take(3, current_version=5, max_staleness=0, block_ms=100)
    assert [g.group_id for g in taken.groups] == ["g3", "g4"] and taken.dead_lettered == 1
    p = progress(jobs)
    assert counts(p) == (1, 1, 1, 1, 2)
    assert p["other"] == {}  # dead letters are their own field, not `other`

    # g3 trained in step 6 and g4 in step 7, one checkpoint after both.
    assert restarted.stepped(["g3"], 6) == 1 and restarted.stepped(["g4"], 7) == 1
    assert counts(progress(jobs)) == (3, 1, 1, 1, 0)
    assert restarted.ack(["g3", "g4", "g0"]) == 2  # g0 again: already out, not counted twice
    p = progress(jobs)
    assert counts(p) == (3, 3, 1, 1, 0)
    assert p["trained"] + p["dropped"] + p["dead_lettered"] + p["in_buffer"] == p["buffered"] == 5
    assert conn.redis.hlen(conn.keys.group_stepped) == 0  # nothing left behind once groups leave
    conn.close()


def test_one_exit_of_many_groups_takes_back_each_jobs_step_marks(redis_url, run_id):
    """EXIT reads every group's step mark in one command: a batch with marked and unmarked
    groups of two jobs (and a repeated id) gives back exactly each job's marks."""
    conn = Buffer(redis_url, run_id)
    groups, jobs = Groups(conn, "trainer-0"), Jobs(conn, "rollout-0")
    for job, n in (("job-a", 3), ("job-b", 4)):
        jobs.describe(job, groups=n, body_hash="h")
    a, b = ["a0", "a1", "a2"], ["b0", "b1", "b2", "b3"]
    groups.put([make_group(g, job_id="job-a") for g in a] + [make_group(g, job_id="job-b") for g in b])
    assert [g.group_id for g in groups.take(7, current_version=0, block_ms=100).groups] == a + b
    assert groups.stepped(["a0", "b0", "b1", "b3"], 1) == 4
    assert (jobs.progress("job-a").stepped, jobs.progress("job-b").stepped) == (1, 3)

    assert groups.ack(["a0", "a1", "b0", "b1", "b2", "a0"]) == 5
    pa, pb = jobs.progress("job-a"), jobs.progress("job-b")
    assert (pa.stepped, pa.exits) == (0, {GroupState.trained: 2})
    assert (pb.stepped, pb.exits) == (1, {GroupState.trained: 3})  # b3: stepped, not acked yet
    assert conn.redis.hkeys(conn.keys.group_stepped) == [b"b3"]
    assert groups.discard(["a2", "b3"], GroupState.zero_spread) == 2
    pa, pb = jobs.progress("job-a"), jobs.progress("job-b")
    assert (pa.stepped, pa.exits) == (0, {GroupState.trained: 2, GroupState.zero_spread: 1})
    assert (pb.stepped, pb.exits) == (0, {GroupState.trained: 3, GroupState.zero_spread: 1})
    assert conn.redis.hlen(conn.keys.group_stepped) == 0
    conn.close()
