"""Client of the environment protocol (`proto/environments.py`): reset and step an episode's
environment, at the reward service or any server that speaks the bodies.

Concurrent calls of one kind to one environment (a step's worth of episodes reset together,
their tool calls answered together) share one `…/reset_batch` or `…/step_batch` request
(services/runtime/coalescer.py): one HTTP round trip for many episodes, not one each.

Transport errors, 5xx and 429 are retried with backoff (environment replicas keep no episode
state, so any replica can take the retry); what is left after the retries, a 4xx, a body that
does not parse and an in-band `mask_sample` all raise `EnvironmentFailed`: the episode cannot
be trusted and the caller starts it again or fails its group, counted. A failed *tool* is not
an error here: it is an observation with a status.
"""

from __future__ import annotations

import time

import httpx
import msgspec
from pydantic import ValidationError

from asyncrl.proto.environments import (
    EnvironmentList,
    ResetRequest,
    ResetResponse,
    ResetResults,
    StepRequest,
    StepResponse,
    StepResults,
)
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import JSON_HEADERS
from asyncrl.services.runtime.coalescer import Coalescer
from asyncrl.services.runtime.retry import Retryable, may_retry, with_retries

RETRY_DELAY_S = 0.2
_JSON = msgspec.json.Encoder()


class EnvironmentFailed(Exception):
    """The environment (not the tool) failed: `kind` names how (counted by it). `retry` false:
    starting the episode again would meet the same failure (the environment said why)."""

    def __init__(self, kind: str, message: str, retry: bool = True):
        super().__init__(message)
        self.kind, self.retry = kind, retry


class EnvClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retries: int,
        listing_ttl_s: float = 30.0,
        headers: dict[str, str] | None = None,
    ):
        self.url = url.rstrip("/")
        self.retries = retries
        self.timeout_s = timeout_s
        self.listing_ttl_s = listing_ttl_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self._listing: tuple[float, EnvironmentList] | None = None
        self._batches = Coalescer(self._post_batch, split_on=EnvironmentFailed, on_split=lambda: None)

    async def aclose(self) -> None:
        await self._batches.aclose()
        await self._http.aclose()

    async def environments(self) -> EnvironmentList:
        """What the server serves (`GET /v1/environments`), cached for `listing_ttl_s`;
        `EnvironmentFailed` when it cannot be read."""
        now = time.monotonic()
        if self._listing and now - self._listing[0] < self.listing_ttl_s:
            return self._listing[1]
        try:
            resp = await self._http.get(f"{self.url}/v1/environments", timeout=10.0)
            resp.raise_for_status()
            listing = EnvironmentList.model_validate_json(resp.content)
        except (httpx.HTTPError, ValidationError) as exc:
            raise EnvironmentFailed(
                "unavailable", f"cannot list the environments at {self.url}: {exc}"
            ) from None
        self._listing = (now, listing)
        return listing

    async def reset(self, env: str, req: ResetRequest) -> ResetResponse:
        return (await self._batches.submit((env, "reset"), [req]))[0]

    async def step(self, env: str, req: StepRequest) -> StepResponse:
        out = (await self._batches.submit((env, "step"), [req]))[0]
        m.ENV_STEPS.labels(env, out.status.value).inc()
        if out.mask_sample:
            raise EnvironmentFailed(
                out.failure_kind or "masked", f"{env} masked the episode: {out.observation[:300]}"
            )
        return out

    async def _post_batch(self, key: tuple[str, str], items: list) -> list:
        env, verb = key
        body = _JSON.encode({"items": [item.model_dump(mode="json") for item in items]})
        model = ResetResults if verb == "reset" else StepResults
        out = (await self._call(env, f"{verb}_batch", body, model)).results
        if len(out) != len(items):
            raise EnvironmentFailed(
                "garbage", f"{env}/{verb}_batch: {len(out)} answers for {len(items)} items"
            )
        return out

    async def _call(self, env: str, verb: str, body: bytes, model):
        async def attempt(_: int):
            try:
                resp = await self._http.post(
                    f"{self.url}/v1/environments/{env}/{verb}", content=body, headers=JSON_HEADERS
                )
            except httpx.HTTPError as exc:
                raise Retryable(f"{type(exc).__name__}: {exc}") from None
            if may_retry(resp.status_code):
                raise Retryable(f"HTTP {resp.status_code}: {resp.text[:300]}")
            if resp.status_code != 200:
                raise EnvironmentFailed(
                    "refused", f"{env}/{verb}: HTTP {resp.status_code}: {resp.text[:300]}"
                )
            try:
                return model.model_validate_json(resp.content)
            except ValidationError as exc:
                raise EnvironmentFailed(
                    "garbage", f"{env}/{verb}: garbage answer: {exc.errors()[:2]}"
                ) from None

        try:
            return await with_retries(attempt, self.retries, first_s=RETRY_DELAY_S)
        except Retryable as exc:
            raise EnvironmentFailed(
                "unavailable", f"{env}/{verb} failed {self.retries + 1} times: {exc}"
            ) from None
