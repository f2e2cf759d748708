"""Group payloads through the buffer: fetched with one MGET per take (redis-py's parser; with
hiredis installed, its C one) and decoded in place, read-only; and the round trips a batch costs."""

from __future__ import annotations

import redis
from factories import make_group

from asyncrl.buffer import Buffer, Groups


def test_large_groups_come_through_the_buffer_intact(redis_url, run_id):
    """Groups of ~400 kB (several socket reads each) taken through one MGET decode to what was
    put, read-only, in place."""
    consumer = Groups(Buffer(redis_url, run_id), "c")
    groups = [make_group(f"g{i}", n=4, n_tokens=8_000 + i) for i in range(5)]
    assert consumer.put(groups) == [True] * 5
    got = consumer.take(5, current_version=0, max_staleness=10, block_ms=100).groups
    assert sorted(g.group_id for g in got) == [g.group_id for g in groups]
    for g in got:
        assert g == next(x for x in groups if x.group_id == g.group_id)
        assert (
            not g.samples.completion_ids.flags.writeable and not g.samples.behavior_logprobs.flags.writeable
        )
    assert consumer.ack([g.group_id for g in got]) == 5
    consumer.buf.close()


def test_a_batch_costs_one_round_trip_to_put_three_to_take_one_to_ack(redis_url, run_id, monkeypatch):
    """Each round trip is a wait for Redis, and on a Redis that fsyncs always each one with a
    write is an fsync: put is one (every payload's `SET NX` and `PUT`, in one MULTI/EXEC), take
    three (`XREADGROUP`; `MGET` with the run's lineage; the staleness counts with the depth),
    ack one (`EXIT`)."""
    consumer = Groups(Buffer(redis_url, run_id), "c")
    warm = [make_group("w0", n=2)]  # the first calls load the scripts (NOSCRIPT, then again)
    consumer.put(warm)
    consumer.ack([g.group_id for g in consumer.take(1, current_version=0, block_ms=100).groups])

    sends = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(conn, command, check_health=True):
        sends.append(command)
        return send(conn, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)

    def round_trips(call):
        sends.clear()
        result = call()
        return len(sends), result

    groups = [make_group(f"g{i}", n=2) for i in range(4)]
    assert round_trips(lambda: consumer.put(groups)) == (1, [True] * 4)
    # ... and queued as one MULTI/EXEC: Redis applies (and fsyncs) the payloads in one turn.
    put = b"".join(sends[0]) if isinstance(sends[0], list) else sends[0]
    assert put.startswith(b"*1\r\n$5\r\nMULTI\r\n") and put.endswith(b"*1\r\n$4\r\nEXEC\r\n")
    trips, taken = round_trips(lambda: consumer.take(4, current_version=0, block_ms=100))
    assert (trips, [g.group_id for g in taken.groups], taken.staleness) == (
        3,
        ["g0", "g1", "g2", "g3"],
        [0] * 4,
    )
    assert round_trips(lambda: consumer.ack(["g0", "g1", "g2", "g3"])) == (1, 4)
    consumer.buf.close()
