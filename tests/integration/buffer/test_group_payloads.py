"""Group payloads through the buffer: fetched with one MGET per take (redis-py's parser; with
hiredis installed, its C one) and decoded in place, read-only."""

from __future__ import annotations

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
