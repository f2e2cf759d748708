"""Client of the reward service (`POST /v1/rewards`, `GET /v1/verifiers`).

`score` never invents a reward: a batch that times out gives every item status `timeout`, a
transport error or a garbage answer (after `retries`) gives `error`, an item missing from the
answer gives `error`; each outcome is counted. Batches in flight are bounded by a semaphore.
Concurrent `score` calls arriving within `COALESCE_S` share one request (ids are re-keyed so
they stay unique); a merged batch the service refuses is retried caller by caller, so one
caller's bad item never marks another's `invalid_input`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from pydantic import ValidationError

from proto.records import RewardStatus
from proto.rewards import RewardItem, RewardRequest, RewardResponse, RewardResult, VerifierList
from services.common.logging import log_event
from services.rollout import metrics as m
from services.rollout.batching import chunk_by_size

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5  # first delay between reward retries; doubles
COALESCE_S = 0.005  # how long a score call waits for others to share its request
MAX_COALESCED_ITEMS = 1024  # items in one coalesced request at most


class _BatchFailed(Exception):
    """The whole batch failed (refused, timed out, transport error, garbage): `status` for each item."""

    def __init__(self, status: RewardStatus, reason: str):
        super().__init__(reason)
        self.status = status


class VerifiersUnavailable(Exception):
    """The reward service could not tell which verifiers it serves."""


class RewardClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        concurrency: int,
        retries: int,
        verifiers_ttl_s: float,
        headers: dict[str, str] | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.verifiers_ttl_s = verifiers_ttl_s
        self._sem = asyncio.Semaphore(concurrency)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self._verifiers: tuple[float, dict[str, dict]] | None = None
        self._waiting: list[tuple[list[RewardItem], asyncio.Future]] = []
        self._flushes: set[asyncio.Task] = set()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """One result per item, in order; never raises for reward-service failures."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiting.append((items, fut))
        if len(self._waiting) == 1:
            loop.call_later(COALESCE_S, self._start_flush)
        results = await fut
        for r in results:
            m.REWARD_RESULTS.labels(r.status.value).inc()
        return results

    def _start_flush(self) -> None:
        waiting, self._waiting = [w for w in self._waiting if not w[1].done()], []
        for chunk in chunk_by_size(waiting, lambda w: len(w[0]), MAX_COALESCED_ITEMS):
            task = asyncio.ensure_future(self._send(chunk))
            self._flushes.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._flushes.discard)

    async def _send(self, chunk: list[tuple[list[RewardItem], asyncio.Future]]) -> None:
        merged = [item.model_copy(update={"id": f"{k}/{item.id}"}) for k, (items, _) in enumerate(chunk)
                  for item in items]  # fmt: skip
        async with self._sem:
            t0 = time.perf_counter()
            try:
                results = await self._score(merged)
            except _BatchFailed as exc:
                if len(chunk) == 1:
                    results = _all(merged, exc.status, str(exc))
                else:
                    results = None
            m.REWARD_SECONDS.observe(time.perf_counter() - t0)
        if results is None:  # a merged batch failed as a whole: each caller gets its own outcome
            m.REWARD_CALLS.labels("split").inc()
            await asyncio.gather(*(self._send([w]) for w in chunk))
            return
        offset = 0
        for items, fut in chunk:
            mine = results[offset : offset + len(items)]
            offset += len(items)
            if not fut.done():
                fut.set_result([r.model_copy(update={"id": i.id}) for i, r in zip(items, mine)])

    async def _score(self, items: list[RewardItem]) -> list[RewardResult]:
        body = RewardRequest(items=items).model_dump(mode="json")
        delay = RETRY_DELAY_S
        problem = ""
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.post(f"{self.url}/v1/rewards", json=body)
            except httpx.TimeoutException:
                m.REWARD_CALLS.labels("timeout").inc()
                raise _BatchFailed(RewardStatus.timeout, f"reward service did not answer within {self.timeout_s} s")
            except httpx.HTTPError as exc:
                m.REWARD_CALLS.labels("transport_error").inc()
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    try:
                        results = RewardResponse.model_validate_json(resp.content).results
                    except ValidationError as exc:
                        m.REWARD_CALLS.labels("garbage").inc()
                        problem = f"garbage answer: {exc.errors()[:2]}"
                    else:
                        m.REWARD_CALLS.labels("ok").inc()
                        return _match(items, results)
                elif 400 <= resp.status_code < 500 and resp.status_code != 429:
                    # The batch itself was refused: resending it as it is cannot help.
                    m.REWARD_CALLS.labels("rejected").inc()
                    raise _BatchFailed(RewardStatus.invalid_input, f"HTTP {resp.status_code}: {resp.text[:300]}")
                else:
                    m.REWARD_CALLS.labels("server_error").inc()
                    problem = f"HTTP {resp.status_code}: {resp.text[:300]}"
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay *= 2
        log_event(log, "reward batch failed", logging.WARNING, items=len(items), problem=problem)
        raise _BatchFailed(RewardStatus.error, problem)

    async def verifiers(self) -> dict[str, dict]:
        """Verifiers served by the reward service, name → JSON schema of its spec arguments
        (`GET /v1/verifiers`), cached for `verifiers_ttl_s`."""
        now = time.monotonic()
        if self._verifiers and now - self._verifiers[0] < self.verifiers_ttl_s:
            return self._verifiers[1]
        try:
            resp = await self._http.get(f"{self.url}/v1/verifiers", timeout=10.0)
            resp.raise_for_status()
            listed = VerifierList.model_validate_json(resp.content).verifiers
        except (httpx.HTTPError, ValidationError) as exc:
            raise VerifiersUnavailable(
                f"cannot list the reward service's verifiers at {self.url}: {exc}"
            ) from exc
        served = {v.name: v.spec_schema for v in listed}
        self._verifiers = (now, served)
        return served


def _all(items: list[RewardItem], status: RewardStatus, reason: str) -> list[RewardResult]:
    return [RewardResult(id=i.id, status=status, details={"error": reason}) for i in items]


def _match(items: list[RewardItem], results: list[RewardResult]) -> list[RewardResult]:
    by_id = {r.id: r for r in results}
    lost = {"error": "item missing from the reward service's answer"}
    return [by_id.get(i.id) or RewardResult(id=i.id, status=RewardStatus.error, details=lost) for i in items]
