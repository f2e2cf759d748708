"""A short load test of the rollout service's front door (`benchmarks/load_rollout.py`, whose
longer runs are in benchmarks/RESULTS.md "Reliability"): open-loop POSTs at a fixed rate for a
few seconds against the real topology (redis-server, reward service, rollout service). Every
request is answered, none with a 5xx, and every accepted job's groups are in the job stream
exactly once. No timing is asserted: the rate is modest for a busy 2-core CI machine."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.load_rollout import account, run_rate, topology

pytestmark = pytest.mark.slow


def test_rollout_intake_under_load_answers_everything_and_loses_nothing(tmp_path):
    with topology(tmp_path) as (url, redis_url, run):
        # A fresh service answers its first requests slowly (caches, the first tokenization): on a
        # slow machine 60/s against a cold service can pass the in-flight cap and be shed. Warm it.
        warm = asyncio.run(run_rate(url, rate=5, seconds=1, prompts=2, tag="warm", timeout_s=60))
        steady = asyncio.run(run_rate(url, rate=60, seconds=3, prompts=2, tag="a", timeout_s=60))
        # the same idempotency keys again: duplicates, nothing enqueued twice
        replay = asyncio.run(run_rate(url, rate=60, seconds=3, prompts=2, tag="a", timeout_s=60))
        acc = account(redis_url, run, [warm, steady])
    assert warm.statuses == {202: 5} and len(warm.accepted) == 5, warm.statuses
    assert steady.errors == 0 and replay.errors == 0
    assert steady.statuses == {202: 180}, steady.statuses
    assert replay.statuses == {202: 180}, replay.statuses
    assert set(replay.accepted) == set(steady.accepted)
    assert acc["exact"] and acc["groups_accepted"] == 370 and acc["jobs_accepted"] == 185, acc
