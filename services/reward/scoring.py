"""Scoring a batch: validate every spec, then verify items concurrently under per-verifier
concurrency limits and budgets, with a content-addressed result cache.

Guarantees:
* A request whose spec names an unknown verifier, or whose arguments do not fit the
  verifier's schema or this server's limits, is rejected whole (HTTP 422, every problem
  listed with its item id) before anything runs: it is a client bug, not a sample outcome.
* Every accepted item gets exactly one result. An item waits at most `queue_timeout_s` for a
  verifier slot and then at most the verifier's item budget; past either it is `timeout`
  (so a batch never waits on its slowest item longer than that). An `inline` verifier (a pure
  function, verifiers/base.py) is judged at once in the request's task, with no slot or budget
  (nothing could interrupt it). A verifier that raises is `error` with the exception in
  `details` and is counted; nothing becomes a silent 0.
* Only deterministic outcomes are cached (`scored`, `invalid_input`); the key is a SHA-256 of
  (verifier, spec arguments, completion), plus the prompt for verifiers that read it.
  Identical items in flight at the same time are verified once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import RewardItem, RewardRequest, RewardResponse, RewardResult, RewardSpec
from asyncrl.proto.verifiers import SpecError
from asyncrl.services.reward.metrics import CACHE_HITS, CACHE_MISSES, ITEMS, LATENCY, VERIFIER_FAILURES
from asyncrl.services.reward.verifiers.base import Verdict, Verifier
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

CACHEABLE = frozenset({RewardStatus.scored, RewardStatus.invalid_input})
# Parsed specs kept across batches (a run's specs repeat: the demo's is `{}` for every group),
# each at most this long as JSON, this many at most.
SPEC_MEMO_CHARS = 4096
SPEC_MEMO_ENTRIES = 1024


class RequestRejected(ValueError):
    """The batch failed validation; `problems` lists `{"id", "loc", "msg"}` per bad item."""

    def __init__(self, problems: list[dict]):
        super().__init__(f"{len(problems)} invalid item(s)")
        self.problems = problems


class _Item(NamedTuple):
    """What an inline verdict reads of an item (`RewardItem`'s fields), for `judge_group`."""

    id: str
    prompt: str
    completion: str
    spec: RewardSpec


@dataclass
class Job:
    item: RewardItem | _Item
    verifier: Verifier
    spec: BaseModel
    key: str


class ResultCache:
    """LRU map from content hash to verdict."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Verdict] = OrderedDict()

    def get(self, key: str) -> Verdict | None:
        verdict = self._entries.get(key)
        if verdict is not None:
            self._entries.move_to_end(key)
        return verdict

    def put(self, key: str, verdict: Verdict) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = verdict
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class Scorer:
    def __init__(self, verifiers: dict[str, Verifier], *, cache_entries: int, queue_timeout_s: float):
        self.verifiers = verifiers
        self.queue_timeout_s = queue_timeout_s
        self.cache = ResultCache(cache_entries)
        self._slots = {name: asyncio.Semaphore(v.concurrency) for name, v in verifiers.items()}
        self._inflight: dict[str, asyncio.Future] = {}
        self._latency = {
            name: LATENCY.labels(name) for name in verifiers
        }  # (a label lookup per item costs more than a toy verdict)
        self._specs: OrderedDict[tuple[str, str], tuple[BaseModel, Any] | SpecError] = OrderedDict()

    async def start(self) -> None:
        await asyncio.gather(*(v.start() for v in self.verifiers.values()))

    async def close(self) -> None:
        await asyncio.gather(*(v.close() for v in self.verifiers.values()), return_exceptions=True)

    def prepare(self, request: RewardRequest) -> list[Job]:
        """Validate every item's spec; raise RequestRejected listing all problems. Equal specs
        are parsed once per batch (a group's samples share theirs), and short ones once while
        they stay among the last SPEC_MEMO_ENTRIES parsed."""
        jobs, problems = [], []
        parsed: dict[tuple[str, str], tuple[BaseModel, Any] | SpecError] = {}  # this batch's
        same: dict[int, tuple[str, str]] = {}  # id(spec object) → its key: a group's items share one object
        for index, item in enumerate(request.items):
            verifier = self.verifiers.get(item.spec.verifier)
            if verifier is None:
                known = ", ".join(sorted(self.verifiers))
                msg = f"unknown or disabled verifier {item.spec.verifier!r}; this server serves: {known}"
                problems.append({"id": item.id, "loc": ["items", index, "spec", "verifier"], "msg": msg})
                continue
            key = same.get(id(item.spec))
            if key is None:
                args = item.spec.args()
                key = same[id(item.spec)] = (verifier.name, json.dumps(args, sort_keys=True))
            # (a key not parsed in this batch was made just above, from this item's `args`)
            seen = parsed.get(key) or self._parse(verifier, args, key[1])
            parsed[key] = seen
            if isinstance(seen, SpecError):
                problems.append(
                    {"id": item.id, "loc": ["items", index, "spec"], "msg": f"{verifier.name}: {seen}"}
                )
                continue
            spec, dumped = seen
            # An inline verdict is never shared in flight: without a cache it needs no key.
            cache_key = (
                self._key(verifier, spec, dumped, item)
                if self.cache.max_entries > 0 or not verifier.inline
                else ""
            )
            jobs.append(Job(item, verifier, spec, cache_key))
        if problems:
            raise RequestRejected(problems)
        return jobs

    def _parse(
        self, verifier: Verifier, args: dict[str, Any], canonical: str
    ) -> tuple[BaseModel, Any] | SpecError:
        """The spec `args` (`canonical`: as sorted JSON) parsed, with its JSON dump, or why not;
        short ones kept among the last SPEC_MEMO_ENTRIES."""
        key = (verifier.name, canonical)
        seen = self._specs.get(key)
        if seen is None:
            try:
                spec = verifier.parse_spec(args)
                seen = (spec, spec.model_dump(mode="json"))
            except SpecError as exc:
                seen = exc
            if len(canonical) <= SPEC_MEMO_CHARS:
                self._specs[key] = seen
                if len(self._specs) > SPEC_MEMO_ENTRIES:
                    self._specs.popitem(last=False)
        return seen

    def judge_group(self, spec: RewardSpec, prompt: str, completions: list[str]) -> list[Verdict]:
        """The verdicts of `completions` of one `prompt` under one `spec` of an inline verifier,
        judged at once (the rollout scores a group with this: no item objects to build). Raises
        RequestRejected as `prepare` would."""
        verifier = self.verifiers.get(spec.verifier)
        if verifier is None or not verifier.inline:
            msg = f"{spec.verifier!r} is not an inline verifier of this scorer ({', '.join(sorted(self.verifiers))})"
            raise RequestRejected([{"id": "0", "loc": ["spec", "verifier"], "msg": msg}])
        args = spec.args()
        seen = self._parse(verifier, args, json.dumps(args, sort_keys=True))
        if isinstance(seen, SpecError):
            raise RequestRejected([{"id": "0", "loc": ["spec"], "msg": f"{verifier.name}: {seen}"}])
        parsed, dumped = seen
        keyed = self.cache.max_entries > 0  # (an inline verdict is never shared in flight: no cache, no key)
        items = [_Item(str(i), prompt, c, spec) for i, c in enumerate(completions)]
        return self.verdicts_now(
            [
                Job(item, verifier, parsed, self._key(verifier, parsed, dumped, item) if keyed else "")
                for item in items
            ]
        )

    @staticmethod
    def _key(verifier: Verifier, spec: BaseModel, dumped: Any, item: RewardItem) -> str:
        """`dumped`: `spec.model_dump(mode="json")`."""
        prompt = item.prompt if verifier.uses_prompt(spec) else None
        payload = [verifier.name, dumped, prompt, item.completion]
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    async def score(self, jobs: list[Job]) -> RewardResponse:
        verdicts = await self.verdicts(jobs)
        # Built from checked verdicts: `model_construct` skips re-validating each result.
        return RewardResponse.model_construct(
            results=[
                RewardResult.model_construct(
                    id=job.item.id, status=v.status, reward=v.reward, details=v.details, formatted=v.formatted
                )
                for job, v in zip(jobs, verdicts)
            ]
        )

    async def verdicts(self, jobs: list[Job]) -> list[Verdict]:
        """Each job's verdict, in order."""
        judged: list[tuple[Verdict, bool] | None] = [
            self._score_inline(job) if job.verifier.inline else None for job in jobs
        ]
        others = [i for i, v in enumerate(judged) if v is None]
        for i, verdict in zip(others, await asyncio.gather(*(self._score_one(jobs[i]) for i in others))):
            judged[i] = verdict
        return self._counted(jobs, judged)

    def verdicts_now(self, jobs: list[Job]) -> list[Verdict]:
        """`verdicts` of jobs whose verifiers are all `inline`, judged at once (no await)."""
        return self._counted(jobs, [self._score_inline(job) for job in jobs])

    @staticmethod
    def _counted(jobs: list[Job], judged: list) -> list[Verdict]:
        """The verdicts of `judged` ((verdict, cached) pairs), counted per batch: one labelled
        child per (verifier, outcome); per item, the label lookups cost more than a toy
        verifier's verdict."""
        hits, outcomes = Counter(), Counter()
        for job, (v, cached) in zip(jobs, judged):
            hits[job.verifier.name, cached] += 1
            outcomes[job.verifier.name, v.status.value, v.details.get("reason", "unknown")] += 1
        for (name, cached), n in hits.items():
            (CACHE_HITS if cached else CACHE_MISSES).labels(name).inc(n)
        for (name, status, reason), n in outcomes.items():
            ITEMS.labels(name, status).inc(n)
            if status in (RewardStatus.timeout, RewardStatus.error):
                VERIFIER_FAILURES.labels(name, str(reason)).inc(n)
        return [v for v, _ in judged]

    def _score_inline(self, job: Job) -> tuple[Verdict, bool]:
        """`_score_one` for an `inline` verifier: judged at once, in the request's task (no item of
        it is ever in flight for another request to share)."""
        verdict = self.cache.get(job.key)
        if verdict is not None:
            return verdict.cached(), True
        started = time.monotonic()
        try:
            verdict = job.verifier.judge(job.spec, job.item.prompt, job.item.completion)
        except Exception as exc:  # noqa: BLE001 -- a verifier bug must not sink the batch
            verdict = self._crashed(job, exc)
        self._latency[job.verifier.name].observe(time.monotonic() - started)
        if verdict.status in CACHEABLE:
            self.cache.put(job.key, verdict)
        return verdict, False

    async def _score_one(self, job: Job) -> tuple[Verdict, bool]:
        """The item's verdict, and whether it came from the cache or an identical item in flight."""
        verdict = self.cache.get(job.key) or await self._shared(job.key)
        if verdict is not None:
            return verdict.cached(), True
        future = asyncio.get_running_loop().create_future()
        self._inflight[job.key] = future
        try:
            verdict = await self._verify(job)
            future.set_result(verdict)
        finally:
            if self._inflight.get(job.key) is future:
                del self._inflight[job.key]
            if not future.done():  # we were cancelled: waiters verify the item themselves
                future.cancel()
        if verdict.status in CACHEABLE:
            self.cache.put(job.key, verdict)
        return verdict, False

    async def _shared(self, key: str) -> Verdict | None:
        """The verdict of an identical item being verified right now, if any (and it finishes)."""
        future = self._inflight.get(key)
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():  # its owner was cancelled, not us
                return None
            raise

    async def _verify(self, job: Job) -> Verdict:
        verifier, slots = job.verifier, self._slots[job.verifier.name]
        started = time.monotonic()
        # `asyncio.timeout` bounds the current task; `wait_for` would start a task per item.
        try:
            if slots.locked():
                async with asyncio.timeout(self.queue_timeout_s):
                    await slots.acquire()
            else:
                await slots.acquire()  # a free slot: taken without waiting
        except TimeoutError:
            return Verdict.failed(RewardStatus.timeout, "queue_timeout", waited_s=self.queue_timeout_s)
        budget = verifier.item_timeout_s(job.spec)
        try:
            async with asyncio.timeout(budget):
                return await verifier.verify(job.spec, job.item.prompt, job.item.completion)
        except TimeoutError:
            return Verdict.failed(RewardStatus.timeout, "item_timeout", timeout_s=budget)
        except Exception as exc:  # noqa: BLE001 -- a verifier bug must not sink the batch
            return self._crashed(job, exc)
        finally:
            slots.release()
            LATENCY.labels(verifier.name).observe(time.monotonic() - started)

    @staticmethod
    def _crashed(job: Job, exc: Exception) -> Verdict:
        log_event(
            log,
            "verifier crashed",
            logging.ERROR,
            verifier=job.verifier.name,
            item=job.item.id,
            error=repr(exc),
        )
        return Verdict.failed(
            RewardStatus.error, "verifier_crashed", error=f"{type(exc).__name__}: {exc}"[:500]
        )
