"""Client of SGLang's native HTTP API for a set of engines (real SGLang servers, `sglang-router`
or the reference engine: all speak the bodies in `proto/sglang.py`).

Guarantees:
* `generate` retries transport errors, 5xx/429 and garbage answers (bodies that do not
  validate as `GenerateResponse`, or whose logprobs do not line up with the tokens) with
  exponential backoff; every retry uses a fresh `rid` with the same prefix, so a retry never
  collides with a request the engine is still running. After `retries` it raises
  `EngineFailure`; a 4xx answer raises `EngineRejected` at once (the request is wrong, not the
  engine).
* An engine with `unhealthy_after` consecutive failures is marked unhealthy and gets no new
  work; a background probe (`GET /health`) brings it back. `pick()` chooses among healthy
  engines by least in-flight requests, ties broken round-robin, and waits while none is
  healthy. Callers keep affinity by passing the same `Engine` for a whole group.
* Control calls (`pause`, `update_weights_from_disk`, `flush_cache`, `continue_generation`)
  go to the admin URLs (the workers, when generation goes through a router).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field

import httpx
from pydantic import TypeAdapter, ValidationError

from proto.sglang import GenerateResponse, UpdateWeightFromDiskReqOutput
from services.common.logging import log_event
from services.rollout import metrics as m

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_BACKOFF_S = 10.0  # one engine retry never sleeps longer than this
GENERATE_KEEPALIVE = 256  # idle generation connections kept; concurrency is bounded by active groups


class EngineFailure(Exception):
    """The engine did not answer usefully after the retries (down, erroring, garbage)."""


class EngineRejected(Exception):
    """The engine refused the request with a 4xx: retrying the same request cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Engine:
    index: int
    url: str
    healthy: bool = True
    failures: int = 0  # consecutive
    in_flight: int = 0
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = str(self.index)


@dataclass
class Generation:
    """One `/generate` answer, checked: tokens, their logprobs, weight version, finish."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    weight_version: str | None
    text: str


class EngineClient:
    def __init__(
        self,
        urls: list[str],
        admin_urls: list[str],
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        unhealthy_after: int,
        probe_s: float,
        update_timeout_s: float,
        headers: dict[str, str] | None = None,
    ):
        self.engines = [Engine(i, u) for i, u in enumerate(urls)]
        self.admins = [Engine(i, u) for i, u in enumerate(admin_urls)]
        self.retries, self.backoff_s = retries, backoff_s
        self.unhealthy_after, self.probe_s = unhealthy_after, probe_s
        self.update_timeout_s = update_timeout_s
        # Generation requests can sit in a paused engine for as long as a weight update takes;
        # they get a pool sized for them, and control calls (pause, update, flush, continue,
        # abort, probes) get their own, so an update is never queued behind the requests it
        # is about to release.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=GENERATE_KEEPALIVE),
        )  # fmt: skip
        self._control_http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self._rr = itertools.count()
        self._health_changed = asyncio.Event()
        for e in self.engines:
            m.ENGINE_HEALTHY.labels(e.label).set(1)

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._control_http.aclose()

    # --- choosing an engine -----------------------------------------------------------------

    async def pick(self) -> Engine:
        """A healthy engine with the fewest requests in flight; waits while none is healthy."""
        while True:
            healthy = [e for e in self.engines if e.healthy]
            if healthy:
                start = next(self._rr) % len(healthy)
                rotated = healthy[start:] + healthy[:start]
                return min(rotated, key=lambda e: e.in_flight)
            self._health_changed.clear()
            try:
                await asyncio.wait_for(self._health_changed.wait(), timeout=self.probe_s)
            except TimeoutError:
                pass

    def _record(self, engine: Engine, op: str, ok: bool) -> None:
        m.ENGINE_REQUESTS.labels(engine.label, op, "ok" if ok else "error").inc()
        if engine not in self.engines:
            return
        if ok:
            engine.failures = 0
            return
        engine.failures += 1
        if engine.healthy and engine.failures >= self.unhealthy_after:
            engine.healthy = False
            m.ENGINE_HEALTHY.labels(engine.label).set(0)
            log_event(
                log, "engine marked unhealthy", logging.WARNING, engine=engine.url, failures=engine.failures
            )

    async def probe_unhealthy(self) -> None:
        """Run forever: `GET /health` on unhealthy engines; a 200 puts one back in service."""
        while True:
            await asyncio.sleep(self.probe_s)
            for e in [e for e in self.engines if not e.healthy]:
                try:
                    ok = (
                        await self._control_http.get(f"{e.url}/health", timeout=self.probe_s * 5)
                    ).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    e.healthy, e.failures = True, 0
                    m.ENGINE_HEALTHY.labels(e.label).set(1)
                    self._health_changed.set()
                    log_event(log, "engine healthy again", engine=e.url)

    # --- generation -------------------------------------------------------------------------

    async def generate(
        self, engine: Engine, inputs: list[list[int]], sampling_params: list[dict], rid: str, in_flight: set[str]
    ) -> list[Generation]:
        """Generate for every input (one answer per input, in order) in as few requests as
        possible: items with the same sampling params go as one SGLang batch. `in_flight`
        holds the item rids while their request runs (so a cancel can abort them).

        Batches carry one `sampling_params` map and one string `rid` (items become
        `rid_0`, `rid_1`, …), the form SGLang and sglang-router both accept.
        """
        by_params: dict[str, list[int]] = {}
        for i, params in enumerate(sampling_params):
            by_params.setdefault(json.dumps(params, sort_keys=True), []).append(i)
        answers: list[Generation | None] = [None] * len(inputs)

        async def batch(k: int, items: list[int]) -> None:
            gens = await self._generate_batch(
                engine, [inputs[i] for i in items], sampling_params[items[0]], f"{rid}-b{k}", in_flight
            )
            for i, gen in zip(items, gens):
                answers[i] = gen

        tasks = [asyncio.ensure_future(batch(k, items)) for k, items in enumerate(by_params.values())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()  # the first failure ends the others
        return answers  # type: ignore[return-value]

    async def _generate_batch(
        self, engine: Engine, inputs: list[list[int]], params: dict, rid: str, in_flight: set[str]
    ) -> list[Generation]:
        body = {"input_ids": inputs, "sampling_params": params, "return_logprob": True}
        delay = self.backoff_s
        last = "no attempt"
        for attempt in range(self.retries + 1):
            body["rid"] = rid if attempt == 0 else f"{rid}-r{attempt}"
            item_rids = {f"{body['rid']}_{j}" for j in range(len(inputs))}
            in_flight |= item_rids
            engine.in_flight += len(inputs)
            m.ENGINE_IN_FLIGHT.labels(engine.label).set(engine.in_flight)
            try:
                resp = await self._http.post(f"{engine.url}/generate", json=body)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                resp = None
            finally:
                in_flight -= item_rids
                engine.in_flight -= len(inputs)
                m.ENGINE_IN_FLIGHT.labels(engine.label).set(engine.in_flight)
            if resp is not None:
                if 400 <= resp.status_code < 500 and resp.status_code not in RETRY_STATUSES:
                    self._record(engine, "generate", True)  # the engine is fine; the request is not
                    raise EngineRejected(_error_message(resp), resp.status_code)
                if resp.status_code == 200:
                    try:
                        out = _parse_generations(resp, len(inputs))
                    except ValueError as exc:
                        last = f"garbage response: {exc}"
                    else:
                        self._record(engine, "generate", True)
                        return out
                else:
                    last = f"HTTP {resp.status_code}: {_error_message(resp)}"
            self._record(engine, "generate", False)
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
        raise EngineFailure(f"engine {engine.url} failed {self.retries + 1} times; last: {last}")

    async def abort(self, engine: Engine, rid: str) -> None:
        """Best effort: ask the engine to stop `rid` (its partial output is discarded by the caller)."""
        try:
            await self._control_http.post(f"{engine.url}/abort_request", json={"rid": rid}, timeout=10.0)
        except httpx.HTTPError:
            m.ENGINE_REQUESTS.labels(engine.label, "abort", "error").inc()

    # --- weight updates (admin engines) -----------------------------------------------------

    async def update_all_from_disk(self, path: str, version: int) -> list[str]:
        """Pause (aborting in-flight requests, which come back with their partial tokens),
        load `path` as `version`, flush the cache and continue, on every admin engine at once.
        Returns the errors (empty on success)."""
        results = await asyncio.gather(*(self._update_one(e, path, version) for e in self.admins))
        return [r for r in results if r]

    async def _update_one(self, e: Engine, path: str, version: int) -> str | None:
        timeout = self.update_timeout_s
        try:
            await self._control(e, "pause_generation", {"mode": "abort"}, timeout)
            try:
                resp = await self._control_http.post(
                    f"{e.url}/update_weights_from_disk",
                    json={"model_path": path, "weight_version": str(version), "flush_cache": True},
                    timeout=timeout,
                )
                try:
                    out = UpdateWeightFromDiskReqOutput.model_validate_json(resp.content)
                except ValidationError:
                    return f"{e.url}: garbage answer to update_weights_from_disk (HTTP {resp.status_code})"
                if not out.success:
                    return f"{e.url}: {out.message}"
                # The update flushes too (flush_cache=True); an explicit flush after it makes
                # sure no prefix computed under the old weights survives on any SGLang version.
                await self._control(e, "flush_cache", None, timeout)
            finally:
                await self._control(e, "continue_generation", {}, timeout)
        except httpx.HTTPError as exc:
            m.ENGINE_REQUESTS.labels(e.label, "update", "error").inc()
            return f"{e.url}: {type(exc).__name__}: {exc}"
        m.ENGINE_REQUESTS.labels(e.label, "update", "ok").inc()
        return None

    async def _control(self, e: Engine, op: str, body: dict | None, timeout: float) -> None:
        resp = await self._control_http.post(f"{e.url}/{op}", json=body, timeout=timeout)
        ok = resp.status_code == 200
        m.ENGINE_REQUESTS.labels(e.label, op, "ok" if ok else "error").inc()
        if not ok:
            log_event(
                log,
                "engine control call failed",
                logging.WARNING,
                engine=e.url,
                op=op,
                status=resp.status_code,
                message=_error_message(resp),
            )

    async def weight_versions(self) -> list[str | None]:
        """`weight_version` of each admin engine (None where it cannot be read)."""

        async def one(e: Engine) -> str | None:
            try:
                resp = await self._control_http.get(f"{e.url}/get_model_info", timeout=10.0)
                return resp.json().get("weight_version") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        return list(await asyncio.gather(*(one(e) for e in self.admins)))


_BATCH = TypeAdapter(list[GenerateResponse])


def _parse_generations(resp: httpx.Response, n: int) -> list[Generation]:
    try:
        outs = _BATCH.validate_json(resp.content)
    except ValidationError as exc:
        raise ValueError(f"not a list of GenerateResponse: {exc.errors()[:2]}") from exc
    if len(outs) != n:
        raise ValueError(f"{len(outs)} answers for a batch of {n}")
    return [_check_generation(out) for out in outs]


def _check_generation(out: GenerateResponse) -> Generation:
    meta = out.meta_info
    lps = meta.output_token_logprobs
    if lps is None:
        raise ValueError("no output_token_logprobs although return_logprob was set")
    if len(lps) != len(out.output_ids) or any(t != tok for (_, t, _), tok in zip(lps, out.output_ids)):
        raise ValueError(f"{len(lps)} logprobs do not match {len(out.output_ids)} output ids")
    logprobs = [float(lp) for lp, _, _ in lps]
    if any(not lp <= 1e-3 for lp in logprobs):  # NaN fails too; ≤ 0 up to rounding (proto MAX_LOGPROB)
        raise ValueError("logprobs must be finite and <= 0")
    return Generation(list(out.output_ids), logprobs, meta.finish_reason.type, meta.weight_version, out.text)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("detail"):
            return str(body["detail"])[:500]
        if body.get("message"):
            return str(body["message"])
    return str(body)[:500]
