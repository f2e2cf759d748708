"""Client of the reward service (`POST /v1/rewards`, `GET /v1/verifiers`).

`score` never invents a reward: a batch that times out gives every item status `timeout`, a
transport error or a garbage answer (after `retries`) gives `error`, an item missing from the
answer gives `error`; each outcome is counted. Batches in flight are bounded by a semaphore.
Concurrent `score` calls share one request (services/runtime/coalescer.py; ids are made unique
by position); a merged batch that fails is sent again caller by caller, so one caller's bad
item never marks another's `invalid_input`.

Items of a `local` verifier (an inline one: a pure function, `[rollout] local_verifiers`) are
scored in this process, with no HTTP round trip, by the `LocalScorer` the reward package
provides under the `asyncrl.local_scorers` entry point (`proto.verifiers`); a caller's item
whose spec that scorer refuses makes that caller's local items `invalid_input`, as the
service's 422 would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import entry_points

import httpx
import msgspec
from pydantic import ValidationError

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import (
    RewardItem,
    RewardResponse,
    RewardResult,
    RewardSpec,
    VerifierList,
)
from asyncrl.proto.verifiers import LOCAL_SCORER, LOCAL_SCORERS, SPECS, LocalScorer, LocalVerdict
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import JSON_HEADERS
from asyncrl.services.runtime.coalescer import Coalescer
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.retry import Retryable, may_retry, with_retries

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5  # first delay between reward retries; doubles
_JSON = msgspec.json.Encoder()


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
        local_verifiers: Sequence[str] = (),
    ):
        self.url = url.rstrip("/")
        self._local = _local_scorer(local_verifiers) if local_verifiers else None
        self.timeout_s = timeout_s
        self.retries = retries
        self.verifiers_ttl_s = verifiers_ttl_s
        self._sem = asyncio.Semaphore(concurrency)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self._verifiers: tuple[float, dict[str, dict]] | None = None
        split = m.REWARD_CALLS.labels("split").inc  # a merged batch failed and went again per caller
        self._batches = Coalescer(self._post_batch, split_on=_BatchFailed, on_split=split)

    async def aclose(self) -> None:
        await self._batches.aclose()
        await self._http.aclose()

    async def score(self, items: list[RewardItem]) -> list[RewardResult | LocalVerdict]:
        """One result per item, in order; never raises for reward-service failures. An item of a
        local verifier gets the local scorer's verdict (not wrapped in a `RewardResult`: per
        item that cost as much as the verdict); both carry `status`, `reward` and `details`."""
        local = self._local.verifiers if self._local is not None else {}
        remote = [item for item in items if item.spec.verifier not in local]
        results = self._score_local([item for item in items if item.spec.verifier in local])
        if remote:
            try:
                answered = iter(await self._batches.submit(None, remote))
            except _BatchFailed as exc:
                answered = iter(
                    [RewardResult(id=i.id, status=exc.status, details={"error": str(exc)}) for i in remote]
                )
            if results:
                mine = iter(results)
                results = [next(mine) if item.spec.verifier in local else next(answered) for item in items]
            else:
                results = list(answered)
        return _counted(results)

    async def score_group(
        self, spec: RewardSpec, prompt: str, completions: list[str]
    ) -> list[RewardResult | LocalVerdict]:
        """`score` for completions of one prompt under one spec (a group's samples): judged here
        when its verifier is local, without building an item per completion."""
        if self._local is None or spec.verifier not in self._local.verifiers:
            # The caller's own strings and checked spec: not validated again.
            return await self.score(
                [
                    RewardItem.model_construct(id=str(i), prompt=prompt, completion=c, spec=spec)
                    for i, c in enumerate(completions)
                ]
            )
        m.REWARD_CALLS.labels("local").inc()
        return _counted(self._local.score_group(spec, prompt, completions))

    def _score_local(self, items: list[RewardItem]) -> list[LocalVerdict]:
        """Inline verifiers, judged here and now."""
        if not items:
            return []
        m.REWARD_CALLS.labels("local").inc()
        return self._local.score(items)

    async def _post_batch(self, _: None, items: list[RewardItem]) -> list[RewardResult]:
        """Score a merged batch, with retries: its items go under ids unique by position and
        their results come back under the callers' ids."""
        # The body is written directly, not through a copy of each item's model: the items were
        # checked when they were built (one spec object is usually shared by a group's items).
        specs: dict[int, dict] = {}
        sent = [f"{j}/{item.id}" for j, item in enumerate(items)]
        body = {
            "items": [
                {
                    "id": sid,
                    "prompt": item.prompt,
                    "completion": item.completion,
                    "spec": specs.get(id(item.spec))
                    or specs.setdefault(id(item.spec), item.spec.model_dump(mode="json")),
                }
                for sid, item in zip(sent, items)
            ]
        }

        async def attempt(_: int) -> list[RewardResult]:
            try:
                resp = await self._http.post(
                    f"{self.url}/v1/rewards", content=_JSON.encode(body), headers=JSON_HEADERS
                )
            except httpx.TimeoutException:
                m.REWARD_CALLS.labels("timeout").inc()
                late = f"reward service did not answer within {self.timeout_s} s"
                raise _BatchFailed(RewardStatus.timeout, late) from None
            except httpx.HTTPError as exc:
                m.REWARD_CALLS.labels("transport_error").inc()
                raise Retryable(f"{type(exc).__name__}: {exc}") from None
            if 400 <= resp.status_code < 500 and not may_retry(resp.status_code):
                # The batch itself was refused: resending it as it is cannot help.
                m.REWARD_CALLS.labels("rejected").inc()
                raise _BatchFailed(RewardStatus.invalid_input, f"HTTP {resp.status_code}: {resp.text[:300]}")
            if resp.status_code != 200:
                m.REWARD_CALLS.labels("server_error").inc()
                raise Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}")
            try:
                results = RewardResponse.model_validate_json(resp.content).results
            except ValidationError as exc:
                m.REWARD_CALLS.labels("garbage").inc()
                raise Retryable(f"garbage answer: {exc.errors()[:2]}") from None
            m.REWARD_CALLS.labels("ok").inc()
            return _match(sent, results)

        async with self._sem:
            t0 = time.perf_counter()
            try:
                results = await with_retries(attempt, self.retries, first_s=RETRY_DELAY_S)
            except Retryable as exc:
                log_event(log, "reward batch failed", logging.WARNING, items=len(items), problem=str(exc))
                raise _BatchFailed(RewardStatus.error, str(exc)) from None
            finally:
                m.REWARD_SECONDS.observe(time.perf_counter() - t0)
        for item, result in zip(items, results):  # (parsed for this call alone: ours to relabel)
            result.id = item.id
        return results

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
        if self._local is not None:
            served |= {name: SPECS[name].model_json_schema() for name in self._local.verifiers}
        self._verifiers = (now, served)
        return served


def _counted(results: list[RewardResult | LocalVerdict]) -> list[RewardResult | LocalVerdict]:
    """`results`, each counted by status."""
    for status, n in Counter(r.status for r in results).items():
        m.REWARD_RESULTS.labels(status.value).inc(n)
    return results


def _local_scorer(names: Sequence[str]) -> LocalScorer:
    """The reward package's scorer of the inline verifiers `names` (its `asyncrl.local_scorers`
    entry point); a ValueError when that package is not installed."""
    found = entry_points(group=LOCAL_SCORERS, name=LOCAL_SCORER)
    if not found:
        raise ValueError(
            f"local_verifiers {list(names)} need the reward package's local scorer "
            f"(entry point {LOCAL_SCORERS}:{LOCAL_SCORER}), which is not installed"
        )
    return next(iter(found)).load()(names)


def _match(ids: list[str], results: list[RewardResult]) -> list[RewardResult]:
    by_id = {r.id: r for r in results}
    lost = {"error": "item missing from the reward service's answer"}
    return [by_id.get(i) or RewardResult(id=i, status=RewardStatus.error, details=lost) for i in ids]
