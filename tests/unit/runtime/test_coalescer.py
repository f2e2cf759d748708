"""Concurrent calls sent together (`services/runtime/coalescer.py`): chunks by size, a coalescer
that answers each caller its own and splits a refused merged call, and group commits."""

from __future__ import annotations

import asyncio


def test_chunk_by_size_keeps_order_and_the_limit():
    from asyncrl.services.runtime.coalescer import chunk_by_size

    # sizes 3,3,2 | 5 | 9 (alone: larger than the limit) | 1 ; limit 8
    assert chunk_by_size([3, 3, 2, 5, 9, 1], lambda n: n, 8) == [[3, 3, 2], [5], [9], [1]]
    assert chunk_by_size([], lambda n: n, 8) == []


class Refused(Exception):
    pass


def coalesce(callers: list[tuple[str, list[str]]], *, max_items: int = 1024):
    """Submit every (key, items) at once to a Coalescer whose send upper-cases the items and
    refuses any batch holding "bad"; each caller's answer or exception, the sends, the splits."""
    from asyncrl.services.runtime.coalescer import Coalescer

    sends, splits = [], []

    async def send(key: str, items: list[str]) -> list[str]:
        sends.append((key, items))
        if "bad" in items:
            raise Refused("bad")
        if "boom" in items:
            raise RuntimeError("boom")
        return [x.upper() for x in items]

    async def go():
        c = Coalescer(send, split_on=Refused, on_split=lambda: splits.append(1), max_items=max_items)
        return await asyncio.gather(*(c.submit(k, items) for k, items in callers), return_exceptions=True)

    return asyncio.run(go()), sends, splits


def test_coalescer_sends_concurrent_calls_of_a_key_together_and_answers_each_its_own():
    answers, sends, splits = coalesce([("k", ["a", "b"]), ("j", ["c"]), ("k", ["d"])])
    assert answers == [["A", "B"], ["C"], ["D"]]
    assert sorted(sends) == [("j", ["c"]), ("k", ["a", "b", "d"])] and splits == []
    # at most max_items per call; a caller's items are never split across calls
    answers, sends, _ = coalesce([("k", ["a", "b"]), ("k", ["c", "d"]), ("k", ["e"])], max_items=3)
    assert answers == [["A", "B"], ["C", "D"], ["E"]]
    assert sorted(sends) == [("k", ["a", "b"]), ("k", ["c", "d", "e"])]


def test_coalescer_resends_a_refused_merged_call_caller_by_caller():
    answers, sends, splits = coalesce([("k", ["a"]), ("k", ["bad"]), ("k", ["c"])])
    assert answers[0] == ["A"] and isinstance(answers[1], Refused) and answers[2] == ["C"]
    assert len(sends) == 4 and splits == [1]  # the merged call, then one per caller
    # any other failure goes to every caller of the call, with no resend
    answers, sends, splits = coalesce([("k", ["a"]), ("k", ["boom"])])
    assert [type(a) for a in answers] == [RuntimeError, RuntimeError] and len(sends) == 1 and splits == []


def test_group_commit_sends_at_once_when_idle_and_batches_what_arrives_meanwhile():
    """The first item goes out alone, at once; the four that arrive while that call runs go out
    together in the next; each caller gets its own answer; one call at a time."""
    from asyncrl.services.runtime.coalescer import GroupCommit

    sends, running, batches = [], [], []

    async def send(items: list[str]) -> list[str]:
        running.append(1)
        assert len(running) == 1, "one call at a time"
        sends.append(list(items))
        await asyncio.sleep(0.01)
        running.pop()
        if "bad" in items:
            raise Refused("bad")
        if "boom" in items:
            raise RuntimeError("boom")
        return [x.upper() for x in items]

    async def go(later: list[str]):
        c = GroupCommit(send, split_on=Refused, on_batch=batches.append)
        first = asyncio.ensure_future(c.submit("a"))
        await asyncio.sleep(0)  # the first call is under way
        rest = [asyncio.ensure_future(c.submit(x)) for x in later]
        return await asyncio.gather(first, *rest, return_exceptions=True)

    assert asyncio.run(go(["b", "c", "d", "e"])) == ["A", "B", "C", "D", "E"]
    assert sends == [["a"], ["b", "c", "d", "e"]] and batches == [1, 4]
    sends.clear()
    answers = asyncio.run(go(["b", "bad", "c"]))  # refused batch: each item again alone
    assert answers[:2] == ["A", "B"] and isinstance(answers[2], Refused) and answers[3] == "C"
    assert sends == [["a"], ["b", "bad", "c"], ["b"], ["bad"], ["c"]]
    sends.clear()
    answers = asyncio.run(go(["b", "boom"]))  # any other failure: every item of that batch
    assert answers[0] == "A" and [type(a) for a in answers[1:]] == [RuntimeError, RuntimeError]
    assert sends == [["a"], ["b", "boom"]]
