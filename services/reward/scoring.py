"""Scoring a batch: validate every spec, then verify items concurrently under per-verifier
concurrency limits and budgets, with a content-addressed result cache.

Guarantees:
* A request whose spec names an unknown verifier, or whose arguments do not fit the
  verifier's schema or this server's limits, is rejected whole (HTTP 422, every problem
  listed with its item id) before anything runs: it is a client bug, not a sample outcome.
* Every accepted item gets exactly one result. An item waits at most `queue_timeout_s` for a
  verifier slot and then at most the verifier's item budget; past either it is `timeout`
  (so a batch never waits on its slowest item longer than that). A verifier that raises is
  `error` with the exception in `details` and is counted; nothing becomes a silent 0.
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
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import BaseModel

from proto.records import RewardStatus
from proto.rewards import RewardItem, RewardRequest, RewardResponse, RewardResult
from services.common.logging import log_event
from services.reward.metrics import CACHE_HITS, CACHE_MISSES, ITEMS, LATENCY, VERIFIER_FAILURES
from services.reward.verifiers.base import SpecError, Verdict, Verifier

log = logging.getLogger(__name__)

CACHEABLE = frozenset({RewardStatus.scored, RewardStatus.invalid_input})


class RequestRejected(ValueError):
    """The batch failed validation; `problems` lists `{"id", "loc", "msg"}` per bad item."""

    def __init__(self, problems: list[dict]):
        super().__init__(f"{len(problems)} invalid item(s)")
        self.problems = problems


@dataclass
class Job:
    item: RewardItem
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

    async def start(self) -> None:
        await asyncio.gather(*(v.start() for v in self.verifiers.values()))

    async def close(self) -> None:
        await asyncio.gather(*(v.close() for v in self.verifiers.values()), return_exceptions=True)

    def prepare(self, request: RewardRequest) -> list[Job]:
        """Validate every item's spec; raise RequestRejected listing all problems."""
        jobs, problems = [], []
        for index, item in enumerate(request.items):
            verifier = self.verifiers.get(item.spec.verifier)
            if verifier is None:
                known = ", ".join(sorted(self.verifiers))
                msg = f"unknown or disabled verifier {item.spec.verifier!r}; this server serves: {known}"
                problems.append({"id": item.id, "loc": ["items", index, "spec", "verifier"], "msg": msg})
                continue
            try:
                spec = verifier.parse_spec(item.spec.args())
            except SpecError as exc:
                problems.append(
                    {"id": item.id, "loc": ["items", index, "spec"], "msg": f"{verifier.name}: {exc}"}
                )
                continue
            jobs.append(Job(item, verifier, spec, self._key(verifier, spec, item)))
        if problems:
            raise RequestRejected(problems)
        return jobs

    @staticmethod
    def _key(verifier: Verifier, spec: BaseModel, item: RewardItem) -> str:
        prompt = item.prompt if verifier.uses_prompt(spec) else None
        payload = [verifier.name, spec.model_dump(mode="json"), prompt, item.completion]
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    async def score(self, jobs: list[Job]) -> RewardResponse:
        verdicts = await asyncio.gather(*(self._score_one(job) for job in jobs))
        return RewardResponse(
            results=[
                RewardResult(id=job.item.id, status=v.status, reward=v.reward, details=v.details)
                for job, v in zip(jobs, verdicts)
            ]
        )

    async def _score_one(self, job: Job) -> Verdict:
        name = job.verifier.name
        verdict = self.cache.get(job.key) or await self._shared(job.key)
        if verdict is not None:
            CACHE_HITS.labels(name).inc()
            verdict = Verdict(verdict.status, verdict.reward, {**verdict.details, "cached": True})
        else:
            CACHE_MISSES.labels(name).inc()
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
        ITEMS.labels(name, verdict.status.value).inc()
        if verdict.status in (RewardStatus.timeout, RewardStatus.error):
            VERIFIER_FAILURES.labels(name, str(verdict.details.get("reason", "unknown"))).inc()
        return verdict

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
        try:
            await asyncio.wait_for(slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            return Verdict.failed(RewardStatus.timeout, "queue_timeout", waited_s=self.queue_timeout_s)
        budget = verifier.item_timeout_s(job.spec)
        try:
            return await asyncio.wait_for(
                verifier.verify(job.spec, job.item.prompt, job.item.completion), budget
            )
        except TimeoutError:
            return Verdict.failed(RewardStatus.timeout, "item_timeout", timeout_s=budget)
        except Exception as exc:  # noqa: BLE001 -- a verifier bug must not sink the batch
            log_event(
                log,
                "verifier crashed",
                logging.ERROR,
                verifier=verifier.name,
                item=job.item.id,
                error=repr(exc),
            )
            return Verdict.failed(
                RewardStatus.error, "verifier_crashed", error=f"{type(exc).__name__}: {exc}"[:500]
            )
        finally:
            slots.release()
            LATENCY.labels(verifier.name).observe(time.monotonic() - started)
