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
* Control calls (`update_weights_from_disk`, `continue_generation`) go to the admin URLs
  (the workers, when generation goes through a router).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass, field

import httpx
from pydantic import TypeAdapter, ValidationError

from proto.sglang import GenerateResponse, UpdateWeightFromDiskReqOutput
from services.common.auth import engine_auth_headers
from services.common.logging import log_event
from services.rollout import metrics as m
from services.rollout.batching import chunk_by_size

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_BACKOFF_S = 10.0  # one engine retry never sleeps longer than this
GENERATE_KEEPALIVE = 64  # idle generation connections kept
COALESCE_S = 0.005  # how long a generate call waits for others (same engine, same params) to share its request
MAX_COALESCED_ITEMS = 1024  # items in one coalesced /generate at most


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


@dataclass
class _Waiting:
    """A generate call waiting for its coalesced request."""

    inputs: list[list[int]]
    in_flight: set[str]
    future: asyncio.Future


def _settle(fut: asyncio.Future, *, result=None, exc: BaseException | None = None) -> None:
    if not fut.done():  # a caller cancelled meanwhile (its group was cancelled): nothing to hand over
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


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
        # Engines take the engine token (ASYNCRL_ENGINE_API_TOKEN, else ASYNCRL_API_TOKEN): it
        # replaces any Authorization header the caller passed (services/common/auth.py).
        headers = {**(headers or {}), **engine_auth_headers()}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=GENERATE_KEEPALIVE),
        )  # fmt: skip
        self._control_http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self._rr = itertools.count()
        self._batch_ids = itertools.count()
        self._rid_prefix = uuid.uuid4().hex[:12]  # engine rids stay unique across rollout replicas
        self._pending: dict[tuple[str, str], list[_Waiting]] = {}
        self._background: set[asyncio.Task] = set()  # tasks nobody awaits: coalesced sends, continues
        self._health_changed = asyncio.Event()
        for e in self.engines:
            m.ENGINE_HEALTHY.labels(e.label).set(1)

    async def aclose(self) -> None:
        for task in list(self._background):  # coalesced sends and post-update continues
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
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
        self, engine: Engine, inputs: list[list[int]], sampling_params: list[dict], in_flight: set[str]
    ) -> list[Generation]:
        """Generate for every input (one answer per input, in order) in as few requests as
        possible. Items with the same sampling params share an SGLang batch, and so do the
        calls of other groups for the same engine and params arriving within `COALESCE_S`:
        a step's worth of groups costs a few HTTP requests, not one per sample. `in_flight`
        holds the engine rids of this call's items while their request runs (for cancels).
        """
        by_params: dict[str, list[int]] = {}
        for i, params in enumerate(sampling_params):
            by_params.setdefault(json.dumps(params, sort_keys=True), []).append(i)
        answers: list[Generation | None] = [None] * len(inputs)

        async def batch(key: str, items: list[int]) -> None:
            gens = await self._coalesced(engine, key, sampling_params[items[0]], [inputs[i] for i in items], in_flight)
            for i, gen in zip(items, gens):
                answers[i] = gen

        tasks = [asyncio.ensure_future(batch(key, items)) for key, items in by_params.items()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()  # the first failure ends the others
        return answers  # type: ignore[return-value]

    async def _coalesced(
        self, engine: Engine, key: str, params: dict, inputs: list[list[int]], in_flight: set[str]
    ) -> list[Generation]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        queue = self._pending.setdefault((engine.url, key), [])
        queue.append(_Waiting(inputs, in_flight, fut))
        if len(queue) == 1:
            loop.call_later(COALESCE_S, self._start_flush, engine, key, params)
        return await fut

    def _start_flush(self, engine: Engine, key: str, params: dict) -> None:
        self._spawn(self._flush(engine, key, params))

    def _spawn(self, coro) -> None:
        """Run `coro` as a task nobody awaits; kept here because the loop holds tasks only
        weakly, and cancelled by `aclose`."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _flush(self, engine: Engine, key: str, params: dict) -> None:
        """Send everything waiting under `key`, in requests of at most MAX_COALESCED_ITEMS."""
        waiting = [w for w in self._pending.pop((engine.url, key), []) if not w.future.done()]
        chunks = chunk_by_size(waiting, lambda w: len(w.inputs), MAX_COALESCED_ITEMS)
        m.COALESCED_CALLS.observe(len(waiting))
        await asyncio.gather(*(self._send(engine, params, chunk) for chunk in chunks))

    async def _send(self, engine: Engine, params: dict, chunk: list[_Waiting]) -> None:
        owners = [w.in_flight for w in chunk for _ in w.inputs]
        try:
            gens = await self._generate_batch(engine, [x for w in chunk for x in w.inputs], params, owners)
        except EngineRejected as exc:
            if len(chunk) == 1:
                _settle(chunk[0].future, exc=exc)
                return
            m.COALESCED_SPLITS.inc()  # one caller's input may be what the engine refused: isolate it
            await asyncio.gather(*(self._send(engine, params, [w]) for w in chunk))
            return
        except Exception as exc:  # noqa: BLE001 — handed to every waiting caller, who owns the policy
            for w in chunk:
                _settle(w.future, exc=exc)
            return
        offset = 0
        for w in chunk:
            _settle(w.future, result=gens[offset : offset + len(w.inputs)])
            offset += len(w.inputs)

    async def _generate_batch(
        self, engine: Engine, inputs: list[list[int]], params: dict, owners: list[set[str]]
    ) -> list[Generation]:
        """One `/generate` of a batch with one `sampling_params` map and one string `rid` (items
        become `rid_0`, `rid_1`, …): the form SGLang and sglang-router both accept."""
        body = {"input_ids": inputs, "sampling_params": params, "return_logprob": True}
        rid = f"{self._rid_prefix}-{next(self._batch_ids)}"
        delay = self.backoff_s
        last = "no attempt"
        for attempt in range(self.retries + 1):
            body["rid"] = rid if attempt == 0 else f"{rid}-r{attempt}"
            item_rids = [f"{body['rid']}_{j}" for j in range(len(inputs))]
            for owner, item in zip(owners, item_rids):
                owner.add(item)
            engine.in_flight += len(inputs)
            m.ENGINE_IN_FLIGHT.labels(engine.label).set(engine.in_flight)
            try:
                resp = await self._http.post(f"{engine.url}/generate", json=body)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                resp = None
            finally:
                for owner, item in zip(owners, item_rids):
                    owner.discard(item)
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

    async def update_all_from_disk(self, path: str, version: int | str, only: list[int] | None = None) -> list[str]:
        """Load `path` as `version` (a policy version, or its `weight_version` name with its
        epoch, proto/lineage.py) on every admin engine (or the admin indices in `only`) at
        once, aborting their in-flight requests (which come back with their partial tokens).
        Returns the errors (empty on success). The caller holds back new `/generate` calls
        until this returns."""
        admins = self.admins if only is None else [self.admins[i] for i in only]
        results = await asyncio.gather(*(self._update_one(e, path, version) for e in admins))
        return [r for r in results if r]

    async def _update_one(self, e: Engine, path: str, version: int | str) -> str | None:
        """SGLang's `/update_weights_from_disk` with `abort_all_requests` aborts what is in
        flight, loads the weights under `weight_version` and, with `flush_cache`, drops every
        prefix computed under the old ones. Then `/continue_generation` goes out in the
        background, so an engine someone paused runs again; generation does not wait for it
        (an engine queues requests while paused). A separate pause before the update and a
        flush after it, as separate round trips, made generation stand still twice as long at
        one update per trainer step."""
        try:
            resp = await self._control_http.post(
                f"{e.url}/update_weights_from_disk",
                json={"model_path": path, "weight_version": str(version), "flush_cache": True,
                      "abort_all_requests": True},
                timeout=self.update_timeout_s,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            m.ENGINE_REQUESTS.labels(e.label, "update", "error").inc()
            return f"{e.url}: {type(exc).__name__}: {exc}"
        finally:  # whatever became of the update (a timeout may still have aborted and paused)
            self._spawn(self._continue(e))
        try:
            out = UpdateWeightFromDiskReqOutput.model_validate_json(resp.content)
        except ValidationError:
            out = None
        if out is None or not out.success:
            m.ENGINE_REQUESTS.labels(e.label, "update", "error").inc()
            if out is None:
                return f"{e.url}: garbage answer to update_weights_from_disk (HTTP {resp.status_code})"
            return f"{e.url}: {out.message}"
        m.ENGINE_REQUESTS.labels(e.label, "update", "ok").inc()
        return None

    async def _continue(self, e: Engine) -> None:
        try:
            resp = await self._control_http.post(f"{e.url}/continue_generation", json={},
                                                 timeout=self.update_timeout_s)  # fmt: skip
        except httpx.HTTPError as exc:
            resp, message = None, f"{type(exc).__name__}: {exc}"
        else:
            message = None if resp.status_code == 200 else _error_message(resp) or f"HTTP {resp.status_code}"
        if message is not None:
            m.ENGINE_REQUESTS.labels(e.label, "continue", "error").inc()
            log_event(log, "engine did not continue after a weight update", logging.WARNING, engine=e.url,
                      status=resp.status_code if resp is not None else None, message=message)  # fmt: skip

    async def weight_versions(self, only: list[int] | None = None) -> list[str | None]:
        """`weight_version` of each admin engine, or of the admin indices in `only` (None where
        it cannot be read)."""

        async def one(e: Engine) -> str | None:
            try:
                resp = await self._control_http.get(f"{e.url}/get_model_info", timeout=10.0)
                return resp.json().get("weight_version") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        admins = self.admins if only is None else [self.admins[i] for i in only]
        return list(await asyncio.gather(*(one(e) for e in admins)))


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
