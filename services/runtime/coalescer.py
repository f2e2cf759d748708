"""Concurrent small requests batched into one call: many groups' `/generate` calls become one
request to their engine, many groups' reward batches one `/v1/rewards`.

`submit(key, items)` calls arriving within `window_s` of the first for the same key go out
together as one `send(key, items)` (which answers one result per item, in order), in calls of
at most `max_items` items, a caller's items never split; each caller gets its own answers. When
a merged call raises `split_on`, each caller's items are sent again alone, so one caller's bad
input never fails another; any other exception goes to every caller of the call. A caller
cancelled while it waits is left out. Nothing waits longer than `window_s` for company.

`GroupCommit` batches without a window: calls go one at a time, each with whatever arrived
while the previous one ran (the rollout's Redis writes: one fsync per batch, not per group).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")
Result = TypeVar("Result")

# How long a call waits for others to share its request. The rollout admits a batch of groups
# in one call, so their engine and reward calls arrive within a millisecond; each ms here is a
# ms of every step's latency (twice: generation, then scoring).
WINDOW_S = 0.001
MAX_ITEMS = 1024  # items in one coalesced request at most


def chunk_by_size(items: Iterable[Item], size: Callable[[Item], int], limit: int) -> list[list[Item]]:
    """Consecutive chunks whose sizes add up to at most `limit` (an item larger than `limit`
    gets a chunk of its own)."""
    chunks: list[list[Item]] = []
    total = limit
    for item in items:
        if total + size(item) > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += size(item)
    return chunks


@dataclass
class _Caller(Generic[Item, Result]):
    items: list[Item]
    answer: asyncio.Future[list[Result]]


def _settle(
    callers: list[_Caller[Item, Result]], results: list[Result] | None, exc: Exception | None = None
) -> None:
    """Give each caller its slice of `results` (or `exc`), skipping callers cancelled meanwhile."""
    offset = 0
    for c in callers:
        if not c.answer.done():
            if exc is not None:
                c.answer.set_exception(exc)
            else:
                c.answer.set_result(results[offset : offset + len(c.items)])
        offset += len(c.items)


class Coalescer(Generic[Key, Item, Result]):
    def __init__(
        self,
        send: Callable[[Key, list[Item]], Awaitable[list[Result]]],
        *,
        split_on: type[Exception],
        on_split: Callable[[], object],
        on_flush: Callable[[int], object] = lambda callers: None,
        window_s: float = WINDOW_S,
        max_items: int = MAX_ITEMS,
    ):
        self.send, self.split_on, self.on_split, self.on_flush = send, split_on, on_split, on_flush
        self.window_s, self.max_items = window_s, max_items
        self._waiting: dict[Key, list[_Caller[Item, Result]]] = {}
        self._sends: set[asyncio.Task] = set()  # the loop holds tasks only weakly

    async def submit(self, key: Key, items: list[Item]) -> list[Result]:
        """The answers to `items`, sent with whatever else arrives for `key` within `window_s`."""
        loop = asyncio.get_running_loop()
        caller = _Caller(items, loop.create_future())
        waiting = self._waiting.setdefault(key, [])
        waiting.append(caller)
        if len(waiting) == 1:
            loop.call_later(self.window_s, self._flush, key)
        return await caller.answer

    async def aclose(self) -> None:
        """Cancel the calls under way (their callers are being cancelled too: shutdown)."""
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)

    def _flush(self, key: Key) -> None:
        callers = [c for c in self._waiting.pop(key) if not c.answer.done()]
        self.on_flush(len(callers))
        for chunk in chunk_by_size(callers, lambda c: len(c.items), self.max_items):
            task = asyncio.ensure_future(self._send(key, chunk))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, key: Key, callers: list[_Caller[Item, Result]]) -> None:
        try:
            results = await self.send(key, [item for c in callers for item in c.items])
        except Exception as exc:  # noqa: BLE001 — handed to the callers, who own the policy
            if isinstance(exc, self.split_on) and len(callers) > 1:
                self.on_split()  # one caller's items may be what was refused: send each alone
                await asyncio.gather(*(self._send(key, [c]) for c in callers))
                return
            _settle(callers, None, exc)
            return
        _settle(callers, results)


class GroupCommit(Generic[Item, Result]):
    """Calls of one kind, one at a time, each carrying every item that arrived while the one
    before it ran (a database's group commit). An idle committer sends at once: nothing waits
    for company, and under load a slow call (a Redis write that fsyncs) is paid once per batch,
    not once per item. `send(items)` answers one result per item, in order. When it raises
    `split_on` for a batch of several items, each item is sent again alone, so one bad item
    never fails another; any other exception goes to every item of the batch. An item whose
    caller was cancelled after it was taken is still sent (its result is dropped)."""

    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[list[Result]]],
        *,
        split_on: type[Exception],
        on_batch: Callable[[int], object] = lambda items: None,
    ):
        self.send, self.split_on, self.on_batch = send, split_on, on_batch
        self._pending: list[_Caller[Item, Result]] = []
        self._task: asyncio.Task | None = None

    async def submit(self, item: Item) -> Result:
        caller = _Caller([item], asyncio.get_running_loop().create_future())
        self._pending.append(caller)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return (await caller.answer)[0]

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = [c for c in self._pending if not c.answer.done()], []
            if batch:
                self.on_batch(len(batch))
                await self._send(batch)

    async def _send(self, batch: list[_Caller[Item, Result]]) -> None:
        try:
            results = await self.send([c.items[0] for c in batch])
        except Exception as exc:  # noqa: BLE001 — handed to the callers, who own the policy
            if isinstance(exc, self.split_on) and len(batch) > 1:
                for one in batch:  # one at a time, as every call of a group commit goes
                    await self._send([one])
                return
            _settle(batch, None, exc)
            return
        _settle(batch, results)
