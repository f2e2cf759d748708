"""buffer/gathering.py on a real Redis: holding sessions of verifiers rollouts, gathered into one
group in the order named, or refused with the first session that cannot join (nothing moved)."""

from __future__ import annotations

import pytest

from asyncrl.buffer import Buffer, SessionStore
from asyncrl.buffer.gathering import drop_holding, gather, open_holding
from asyncrl.proto import FinishReason
from asyncrl.proto.gateway import Call


@pytest.fixture
def store(redis_url, run_id):
    return SessionStore(Buffer(redis_url, run_id), ttl_s=60.0, lease_s=5.0)


def call(tokens: list[int]) -> Call:
    return Call.of([1, 2], tokens, [-0.5] * len(tokens), [3] * len(tokens), lineage={},
                   finish_reason=FinishReason.stop, text="t", started=1.0, finished=2.0)  # fmt: skip


def holding(store: SessionStore, sid: str, calls: int = 1) -> None:
    assert open_holding(store, sid) == "ok"
    for i in range(calls):
        assert store.record(sid, call([10 + i]), 0) == "ok"


def test_holding_sessions_are_gathered_in_the_order_named(store):
    holding(store, "r.t.a")
    holding(store, "r.t.b", calls=2)
    assert store.close("r.t.a", {"reward": 1.0}) == ["open", "r.t.a"]  # a holding group never completes
    assert gather(store, "r.g.k", ["r.t.b", "r.t.a"], 7) == [
        "taken",
        "r.t.a",
    ]  # closed already: nothing moved
    assert store.session("r.t.b")["group_id"] == "r.t.b"

    holding(store, "r.t.c")
    assert gather(store, "r.g.k", ["r.t.b", "r.t.c"], 7, "p1") == ["ok"]
    assert [(store.session(s)["group_id"], store.session(s)["index"]) for s in ("r.t.b", "r.t.c")] == [
        ("r.g.k", "0"), ("r.g.k", "1"),
    ]  # fmt: skip
    assert not store.group_exists("r.t.b") and not store.group_exists("r.t.c")  # holding groups gone
    assert store.buf.redis.zscore(store.deadlines, "r.t.b") is None
    assert store.close("r.t.b", {"reward": 0.5, "status": "scored", "details": {}})[0] == "open"
    assert store.close("r.t.c", {"reward": 1.5, "status": "scored", "details": {}}) == ["complete", "r.g.k"]
    meta, sessions = store.group("r.g.k")
    assert (meta["size"], meta["prompt_id"], meta["submit_version"]) == ("2", "p1", "7")
    assert [(s.index, len(s.calls), s.result["reward"]) for s in sessions] == [(0, 2, 0.5), (1, 1, 1.5)]
    assert gather(store, "r.g.k", ["r.t.b", "r.t.c"], 7) == ["exists", "complete"]  # a retry


def test_a_session_that_cannot_join_refuses_the_whole_gather(store):
    holding(store, "r.t.x")
    holding(store, "r.t.e", calls=0)
    assert gather(store, "r.g.z", ["r.t.x", "r.t.nope"], 0) == ["unknown", "r.t.nope"]
    assert gather(store, "r.g.z", ["r.t.x", "r.t.e"], 0) == ["empty", "r.t.e"]
    assert not store.group_exists("r.g.z") and store.session("r.t.x")["group_id"] == "r.t.x"
    # a failed group's sessions are dropped with their calls; an unknown one has nothing to drop
    assert (drop_holding(store, "r.t.x"), drop_holding(store, "r.t.nope")) == (True, False)
    assert store.session("r.t.x") == {} and store.last_call("r.t.x") is None
