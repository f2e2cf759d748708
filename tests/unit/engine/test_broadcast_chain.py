"""The reference engine's memory of which whole version broadcasts made its weights
(services/engine/deltas.py `BroadcastChain`): a delta is taken only on top of exactly its base,
a full version counts only once its buckets covered every parameter, and a refusal leaves
nothing a later delta could build on."""

from __future__ import annotations

from asyncrl.services.engine.deltas import BroadcastChain

PARAMS = {"a", "b", "c"}


def chain() -> BroadcastChain:
    return BroadcastChain(lambda names: sorted(PARAMS - set(names)))


def send(
    c: BroadcastChain, group: str, base: str | None, names: list[str], version: str | None
) -> str | None:
    c.applying(group, base, names)
    return c.applied(group, version)


def test_a_full_version_is_held_once_its_buckets_cover_every_parameter():
    c = chain()
    assert send(c, "g", None, ["a", "b"], None) is None and c.held is None
    assert send(c, "g", None, ["c"], "1") is None  # the last bucket: a, b, c covered
    assert c.held == ("g", "1")
    assert send(c, "g", None, ["a"], "2") is None  # a subset named as a version: not whole
    assert c.held is None


def test_a_delta_is_taken_on_its_base_only_and_hashes_must_match():
    c = chain()
    send(c, "g", None, ["a", "b", "c"], "1")
    assert c.refusal("g", "1", {"a": "h"}, {"a": "h"}) is None
    assert send(c, "g", "1", ["a"], None) is None and c.held is None  # half-way: nothing held
    assert c.refusal("g", "1", {"b": "h"}, {"b": "h"}) is None  # the same delta's next bucket
    assert send(c, "g", "1", ["b"], "2") == "applied" and c.held == ("g", "2")
    reason, message = c.refusal("g", "1", {"a": "h"}, {"a": "h"})  # the engine holds 2, not 1
    assert reason == "base" and message == (
        "delta on base '1' refused: this engine holds version '2'; send a full version"
    )
    assert c.held == ("g", "2")  # nothing was applied: the weights are still version 2
    reason, _ = c.refusal("other", "2", {"a": "h"}, {"a": "h"})  # the same name in another group
    assert reason == "base"
    reason, message = c.refusal("g", "2", {"a": "h", "b": "h"}, {"a": "h", "b": "x"})
    assert (reason, message) == (
        "hash",
        "delta on base '2' refused: b: sha256 of the received bytes differs from the announced; "
        "send a full version",
    )


def test_after_a_refusal_half_way_only_a_full_version_is_taken_and_counts_as_the_resync():
    c = chain()
    send(c, "g", None, ["a", "b", "c"], "1")
    send(c, "g", "1", ["a"], None)  # the first bucket of the delta to 2 is in
    assert c.refusal("g", "1", {"b": "h"}, {"b": "x"})[0] == "hash"
    reason, message = c.refusal("g", "1", {"c": "h"}, {"c": "h"})  # the weights are a mix now
    assert reason == "base" and "holds no whole version broadcast in this group" in message
    assert send(c, "g", None, ["a", "b"], None) is None
    assert send(c, "g", None, ["c"], "2") == "resynced" and c.held == ("g", "2")
    assert send(c, "g", None, ["a", "b", "c"], "3") is None  # a plain anchor: no resync to count


def test_clear_forgets_the_version_held():
    c = chain()
    send(c, "g", None, ["a", "b", "c"], "1")
    c.clear()  # a disk load, a copy past its deadline, a dropped group
    assert c.held is None
    assert c.refusal("g", "1", {"a": "h"}, {"a": "h"})[0] == "base"
