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
  healthy. Callers keep affinity by passing the same `EngineEndpoint` for a whole group.
* Control calls (`update_weights_from_disk`, `continue_generation`, `load_lora_adapter`,
  `unload_lora_adapter`) go to the admin URLs (the workers, when generation goes through a
  router); an engine fleet (`services/rollout/fleet.py`) adds and removes admins at run time.
* `generate(..., lora=name)` names a loaded LoRA adapter for every item (`lora_path`); a
  coalesced request holds items of one adapter only.
* Bodies follow SGLang 0.5.23 (`proto/sglang.py`): sampling-param aliases our validation
  accepts (`seed`) are renamed to SGLang's fields before sending, since its schema refuses
  unknown keys; `/model_info` falls back to the deprecated `/get_model_info` on a 404;
  per-token `meta_info.weight_versions` spans become one version per output token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
from pydantic import ValidationError

from asyncrl.proto.limits import MAX_LOGPROB
from asyncrl.proto.sglang import (
    ROUTES,
    ContinueGenerationReqInput,
    FinishType,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqOutput,
    wire_sampling_params,
)
from asyncrl.services.rollout import metrics as m
from asyncrl.services.runtime.auth import engine_auth_headers
from asyncrl.services.runtime.coalescer import Coalescer
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.retry import Retryable, may_retry, with_retries

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0  # one engine retry never sleeps longer than this
GENERATE_KEEPALIVE = 64  # idle generation connections kept
JSON_HEADERS = {"content-type": "application/json"}
_JSON = msgspec.json.Encoder()  # request bodies (the json module is several times slower)
_KEY = msgspec.json.Encoder(order="sorted")  # sampling params as canonical JSON: a batch's key


class EngineFailure(Exception):
    """The engine did not answer usefully after the retries (down, erroring, garbage)."""


class EngineRejected(Exception):
    """The engine refused the request with a 4xx: retrying the same request cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class EngineEndpoint:
    """One engine URL as the rollout sees it: its health and the requests it has in flight."""

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
    # One weight version per output token, from `meta_info.weight_versions` (SGLang 0.5.23);
    # None when the engine reports only `weight_version` (every token has that one).
    token_versions: list[str] | None = None


@dataclass
class AdapterAnswer:
    """What an engine answered to `/load_lora_adapter` or `/unload_lora_adapter`: whether it did
    it, its message, and the adapters it holds afterwards (name → path; None when it did not
    say: a refusal before its LoRA manager, an unreachable engine, a garbage answer)."""

    ok: bool
    message: str = ""
    loaded: dict[str, str] | None = None


# A coalesced `/generate` goes to one engine with one `sampling_params` (its canonical JSON is the
# key) and one LoRA adapter (None: the base model); each of its items is an input, the
# `in_flight` set of the call it came from and the params.
BatchKey = tuple[EngineEndpoint, str, str | None]
BatchItem = tuple[list[int], set[str], dict]


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
        update_abort: bool = True,
        update_in_flight: bool = False,
        headers: dict[str, str] | None = None,
    ):
        self.engines = [EngineEndpoint(i, u) for i, u in enumerate(urls)]
        # The engines weight updates go to. An engine fleet (services/rollout/fleet.py) adds and
        # removes them at run time; an index is never reused, so one names the same engine for
        # as long as anything remembers it (versions served, pins, metric labels).
        self.admins = [EngineEndpoint(i, u) for i, u in enumerate(admin_urls)]
        self._admin_indices = itertools.count(len(admin_urls))
        self.retries, self.backoff_s = retries, backoff_s
        self.unhealthy_after, self.probe_s = unhealthy_after, probe_s
        self.update_timeout_s, self.update_abort = update_timeout_s, update_abort
        self.update_in_flight = update_in_flight
        self._old_routes: set[tuple[str, str]] = set()  # (url, route) answered 404: use the old name
        # Generation requests can sit in a paused engine for as long as a weight update takes;
        # they get a pool sized for them, and control calls (pause, update, flush, continue,
        # abort, probes) get their own, so an update is never queued behind the requests it
        # is about to release.
        # Engines take the engine token (ASYNCRL_ENGINE_API_TOKEN, else ASYNCRL_API_TOKEN): it
        # replaces any Authorization header the caller passed (services/runtime/auth.py).
        headers = {**(headers or {}), **engine_auth_headers()}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=GENERATE_KEEPALIVE),
        )
        self._control_http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers
        )
        self._batches = Coalescer(
            self._post_generate,
            split_on=EngineRejected,
            on_split=m.COALESCED_SPLITS.inc,
            on_flush=m.COALESCED_CALLS.observe,
        )
        self._rr = itertools.count()
        # Narrows the healthy engines `pick` chooses from (None: all of them). With LoRA the
        # weight follower sets it: an engine holding none of the run's adapters gets no group.
        self.eligible: Callable[[list[EngineEndpoint]], list[EngineEndpoint]] | None = None
        self._batch_ids = itertools.count()
        self._rid_prefix = uuid.uuid4().hex[:12]  # engine rids stay unique across rollout replicas
        self._continues: set[asyncio.Task] = set()  # post-update continues nobody awaits
        self._health_changed = asyncio.Event()
        for e in self.engines:
            m.ENGINE_HEALTHY.labels(e.label).set(1)

    async def aclose(self) -> None:
        for task in list(self._continues):
            task.cancel()
        await asyncio.gather(self._batches.aclose(), *self._continues, return_exceptions=True)
        await self._http.aclose()
        await self._control_http.aclose()

    # --- choosing an engine -----------------------------------------------------------------

    async def pick(self) -> EngineEndpoint:
        """A healthy (and `eligible`) engine with the fewest requests in flight; waits while
        there is none."""
        while True:
            healthy = [e for e in self.engines if e.healthy]
            if healthy and self.eligible is not None:
                healthy = self.eligible(healthy)
            if healthy:
                start = next(self._rr) % len(healthy)
                rotated = healthy[start:] + healthy[:start]
                return min(rotated, key=lambda e: e.in_flight)
            self._health_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._health_changed.wait(), timeout=self.probe_s)

    def _record(self, engine: EngineEndpoint, op: str, ok: bool) -> None:
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
        self,
        engine: EngineEndpoint,
        inputs: list[list[int]],
        sampling_params: list[dict],
        in_flight: set[str],
        lora: str | None = None,
    ) -> list[Generation]:
        """Generate for every input (one answer per input, in order) in as few requests as
        possible. Items with the same sampling params share an SGLang batch, and so do the
        calls of other groups for the same engine, params and adapter arriving within the
        coalescing window: a step's worth of groups costs a few HTTP requests, not one per
        sample. `in_flight` holds the engine rids of this call's items while their request runs
        (for cancels). `lora`: the loaded adapter every item names (None: the base model)."""
        sampling_params = [wire_sampling_params(p) for p in sampling_params]
        by_params: dict[str, list[int]] = {}
        for i, params in enumerate(sampling_params):
            by_params.setdefault(_KEY.encode(params).decode(), []).append(i)
        if len(by_params) == 1:  # the usual case (a group's samples share their params): no task
            (key,) = by_params
            return await self._batches.submit(
                (engine, key, lora), [(x, in_flight, p) for x, p in zip(inputs, sampling_params)]
            )
        batches = [
            asyncio.ensure_future(
                self._batches.submit(
                    (engine, key, lora), [(inputs[i], in_flight, sampling_params[i]) for i in items]
                )
            )
            for key, items in by_params.items()
        ]
        try:
            answers = await asyncio.gather(*batches)
        finally:
            for b in batches:
                b.cancel()  # the first failure ends the others
        by_input = {i: gen for items, gens in zip(by_params.values(), answers) for i, gen in zip(items, gens)}
        return [by_input[i] for i in range(len(inputs))]

    async def _post_generate(self, key: BatchKey, items: list[BatchItem]) -> list[Generation]:
        """One `/generate` of a coalesced batch with one `sampling_params` map and one string
        `rid` (items become `rid_0`, `rid_1`, …): the form SGLang and sglang-router both accept.
        Each retry gets a fresh rid; every failed attempt counts against the engine's health."""
        engine, _, lora = key
        inputs = [x for x, _, _ in items]
        body = {"input_ids": inputs, "sampling_params": items[0][2], "return_logprob": True}
        if lora is not None:
            body["lora_path"] = lora
        rid = f"{self._rid_prefix}-{next(self._batch_ids)}"

        async def attempt(n: int) -> list[Generation]:
            body["rid"] = rid if n == 0 else f"{rid}-r{n}"
            item_rids = [f"{body['rid']}_{j}" for j in range(len(items))]
            for (_, owner, _), item in zip(items, item_rids):
                owner.add(item)
            engine.in_flight += len(items)
            m.ENGINE_IN_FLIGHT.labels(engine.label).set(engine.in_flight)
            try:
                resp = await self._http.post(
                    f"{engine.url}/generate", content=_JSON.encode(body), headers=JSON_HEADERS
                )
            except httpx.HTTPError as exc:
                resp, problem = None, f"{type(exc).__name__}: {exc}"
            finally:
                for (_, owner, _), item in zip(items, item_rids):
                    owner.discard(item)
                engine.in_flight -= len(items)
                m.ENGINE_IN_FLIGHT.labels(engine.label).set(engine.in_flight)
            if resp is not None:
                if 400 <= resp.status_code < 500 and not may_retry(resp.status_code):
                    self._record(engine, "generate", True)  # the engine is fine; the request is not
                    raise EngineRejected(_error_message(resp), resp.status_code)
                if resp.status_code != 200:
                    problem = f"HTTP {resp.status_code}: {_error_message(resp)}"
                else:
                    try:
                        out = _parse_generations(resp, len(items), need_spans=self.update_in_flight)
                    except ValueError as exc:
                        problem = f"garbage response: {exc}"
                    else:
                        self._record(engine, "generate", True)
                        return out
            self._record(engine, "generate", False)
            raise Retryable(problem)

        try:
            return await with_retries(attempt, self.retries, first_s=self.backoff_s, max_s=MAX_BACKOFF_S)
        except Retryable as exc:
            raise EngineFailure(f"engine {engine.url} failed {self.retries + 1} times; last: {exc}") from None

    async def abort(self, engine: EngineEndpoint, rid: str) -> None:
        """Best effort: ask the engine to stop `rid` (its partial output is discarded by the caller)."""
        try:
            await self._control_http.post(f"{engine.url}/abort_request", json={"rid": rid}, timeout=10.0)
        except httpx.HTTPError:
            m.ENGINE_REQUESTS.labels(engine.label, "abort", "error").inc()

    # --- weight updates (admin engines) -----------------------------------------------------

    def new_admin(self, url: str) -> EngineEndpoint:
        """An endpoint for an engine about to join the admins (its index never used before);
        it is one of them once appended to `admins`."""
        return EngineEndpoint(next(self._admin_indices), url)

    def _admins_at(self, only: list[int] | None) -> list[EngineEndpoint | None]:
        """The admins with the indices in `only` (all, in order, when None); None for an index
        that is not an admin any more."""
        if only is None:
            return list(self.admins)
        by_index = {e.index: e for e in self.admins}
        return [by_index.get(i) for i in only]

    async def update_all_from_disk(
        self, path: str, version: int | str, only: list[int] | None = None
    ) -> list[str]:
        """Load `path` as `version` (a policy version, or its `weight_version` name with its
        epoch, proto/lineage.py) on every admin engine (or the admin indices in `only`) at
        once, aborting their in-flight requests (which come back with their partial tokens), or
        with `update_abort` false letting them finish under the old weights first. Returns the
        errors (empty on success). The caller holds back new `/generate` calls until this
        returns."""
        admins = [e for e in self._admins_at(only) if e is not None]
        results = await asyncio.gather(*(self.update_from_disk(e, path, version) for e in admins))
        return [r for r in results if r]

    async def update_from_disk(self, e: EngineEndpoint, path: str, version: int | str) -> str | None:
        """SGLang's `/update_weights_from_disk` with `abort_all_requests` aborts what is in
        flight (without: waits for it to finish), loads the weights under `weight_version` and, with `flush_cache`, drops every
        prefix computed under the old ones. Then `/continue_generation` goes out in the
        background, so an engine someone paused runs again; generation does not wait for it
        (an engine queues requests while paused). A separate pause before the update and a
        flush after it, as separate round trips, made generation stand still twice as long at
        one update per trainer step.

        With `update_in_flight` (PipelineRL's in-flight updates) the engine is first paused with
        `mode: retract` (running requests keep their tokens and drop their KV), updated without
        aborting anything and continued: the requests go on under the new weights, their KV
        recomputed, and the engine reports each token's version in `meta_info.weight_versions`.
        """
        try:
            if self.update_in_flight:
                paused = await self._control_http.post(
                    f"{e.url}/pause_generation", json={"mode": "retract"}, timeout=self.update_timeout_s
                )
                if paused.status_code != 200:
                    m.ENGINE_REQUESTS.labels(e.label, "pause", "error").inc()
                    return f"{e.url}: pause_generation: {_error_message(paused)}"
            resp = await self._control_http.post(
                f"{e.url}/update_weights_from_disk",
                json={
                    "model_path": path,
                    "weight_version": str(version),
                    "flush_cache": True,
                    "abort_all_requests": self.update_abort and not self.update_in_flight,
                },
                timeout=self.update_timeout_s,
            )
        except httpx.HTTPError as exc:
            m.ENGINE_REQUESTS.labels(e.label, "update", "error").inc()
            return f"{e.url}: {type(exc).__name__}: {exc}"
        finally:  # whatever became of the update (a timeout may still have aborted and paused)
            task = asyncio.ensure_future(self._continue(e))
            self._continues.add(task)  # the loop holds tasks only weakly
            task.add_done_callback(self._continues.discard)
        try:
            out = UpdateWeightFromDiskReqOutput.model_validate_json(resp.content)
            problem = None if out.success else out.message
        except ValidationError:
            problem = f"garbage answer to update_weights_from_disk (HTTP {resp.status_code})"
        m.ENGINE_REQUESTS.labels(e.label, "update", "ok" if problem is None else "error").inc()
        return None if problem is None else f"{e.url}: {problem}"

    async def _continue(self, e: EngineEndpoint) -> None:
        try:
            resp = await self._control_http.post(
                f"{e.url}/continue_generation",
                json=ContinueGenerationReqInput().model_dump(),
                timeout=self.update_timeout_s,
            )
        except httpx.HTTPError as exc:
            resp, message = None, f"{type(exc).__name__}: {exc}"
        else:
            message = None if resp.status_code == 200 else _error_message(resp) or f"HTTP {resp.status_code}"
        if message is not None:
            m.ENGINE_REQUESTS.labels(e.label, "continue", "error").inc()
            log_event(
                log,
                "engine did not continue after a weight update",
                logging.WARNING,
                engine=e.url,
                status=resp.status_code if resp is not None else None,
                message=message,
            )

    # --- LoRA adapters (admin engines) -----------------------------------------------------

    async def load_adapter(self, e: EngineEndpoint, name: str, path: str) -> AdapterAnswer:
        """SGLang's `/load_lora_adapter`: the PEFT directory `path` under `name`, beside the base
        model (generation goes on meanwhile). Never pinned: the rollout unloads what it loads."""
        body = LoadLoRAAdapterReqInput(lora_name=name, lora_path=path).model_dump()
        return await self._adapter_call(e, "load_lora_adapter", body)

    async def unload_adapter(self, e: EngineEndpoint, name: str) -> AdapterAnswer:
        """SGLang's `/unload_lora_adapter`: answered once the requests that use it have ended."""
        body = UnloadLoRAAdapterReqInput(lora_name=name).model_dump()
        return await self._adapter_call(e, "unload_lora_adapter", body)

    async def _adapter_call(self, e: EngineEndpoint, route: str, body: dict) -> AdapterAnswer:
        op = route.split("_")[0]  # load | unload
        try:
            resp = await self._control_http.post(f"{e.url}/{route}", json=body, timeout=self.update_timeout_s)
        except httpx.HTTPError as exc:
            m.ENGINE_REQUESTS.labels(e.label, op, "error").inc()
            return AdapterAnswer(False, f"{e.url}: {type(exc).__name__}: {exc}")
        try:
            out = LoRAUpdateOutput.model_validate_json(resp.content)
        except ValidationError:
            m.ENGINE_REQUESTS.labels(e.label, op, "error").inc()
            return AdapterAnswer(False, f"{e.url}: {route}: HTTP {resp.status_code}: {_error_message(resp)}")
        m.ENGINE_REQUESTS.labels(e.label, op, "ok" if out.success else "error").inc()
        return AdapterAnswer(out.success, out.error_message or "", out.loaded_adapters)

    async def weight_versions(self, only: list[int] | None = None) -> list[str | None]:
        """`weight_version` of each admin engine, or of the admin indices in `only`, in that
        order (None where it cannot be read, or the index is not an admin any more)."""

        async def one(e: EngineEndpoint | None) -> str | None:
            return None if e is None else await self.weight_version(e)

        return list(await asyncio.gather(*(one(e) for e in self._admins_at(only))))

    async def weight_version(self, e: EngineEndpoint) -> str | None:
        """The `weight_version` engine `e` reports (None where it cannot be read)."""
        try:
            resp = await self.info(e, "/model_info")
            return resp.json().get("weight_version") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    async def reachable(self, url: str, timeout_s: float) -> bool:
        """Whether the engine at `url` answers `GET /health` at all: any HTTP status counts (a
        503 is an engine whose last weight update failed, alive and reporting its version);
        only a transport error (refused, reset, timed out) does not."""
        try:
            await self._control_http.get(f"{url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return True

    async def info(self, e: EngineEndpoint, route: str) -> httpx.Response:
        """`GET route` (`/model_info`, `/server_info`), or its deprecated name (`ROUTES`) where
        the engine answers 404, as servers before 0.5.23's names do; remembered per engine."""
        if (e.url, route) in self._old_routes:
            return await self._control_http.get(f"{e.url}{ROUTES[route]}", timeout=10.0)
        resp, fell_back = await get_info(self._control_http, e.url, route, timeout=10.0)
        if fell_back:
            self._old_routes.add((e.url, route))
        return resp


async def get_info(
    http: httpx.AsyncClient, url: str, route: str, timeout=httpx.USE_CLIENT_DEFAULT
) -> tuple[httpx.Response, bool]:
    """`GET url+route` (`/model_info`, `/server_info`), or its deprecated name (`ROUTES`) where
    the engine answers 404 (counted); the answer and whether it came from the old name."""
    resp = await http.get(f"{url}{route}", timeout=timeout)
    if resp.status_code != 404:
        return resp, False
    m.ENGINE_ROUTE_FALLBACKS.labels(route).inc()
    return await http.get(f"{url}{ROUTES[route]}", timeout=timeout), True


# What the client reads of a `/generate` answer (`proto.sglang.GenerateResponse`), decoded by
# msgspec: the same required fields and types as that model, other fields ignored. (pydantic
# validating the whole response was the largest single cost of this process per sample.)
class _Finish(msgspec.Struct):
    type: FinishType


class _Span(msgspec.Struct):
    version: str
    start: int
    end: int


class _Meta(msgspec.Struct):
    id: str
    finish_reason: _Finish
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None = None
    weight_versions: list[_Span] | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class _Answer(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: _Meta


_BATCH = msgspec.json.Decoder(list[_Answer])


def _parse_generations(resp: httpx.Response, n: int, need_spans: bool = False) -> list[Generation]:
    """The checked answers of a batch of `n`. `need_spans` (in-flight updates): an answer
    without `meta_info.weight_versions` is refused, since one answer may then hold tokens of
    two versions and labelling them all with `weight_version` would hide the older ones from
    the staleness bound."""
    try:
        outs = _BATCH.decode(resp.content)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a list of GenerateResponse: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if len(outs) != n:
        raise ValueError(f"{len(outs)} answers for a batch of {n}")
    if need_spans and any(out.meta_info.weight_versions is None for out in outs):
        raise ValueError(
            "no meta_info.weight_versions: weight_update_in_flight needs an engine that reports "
            "per-token versions (SGLang >= 0.5.23 or the reference engine)"
        )
    return [_check_generation(out) for out in outs]


def _check_generation(out: _Answer) -> Generation:
    meta = out.meta_info
    lps = meta.output_token_logprobs
    if lps is None:
        raise ValueError("no output_token_logprobs although return_logprob was set")
    if len(lps) != len(out.output_ids) or [t for _, t, _ in lps] != out.output_ids:
        raise ValueError(f"{len(lps)} logprobs do not match {len(out.output_ids)} output ids")
    logprobs = [lp for lp, _, _ in lps]
    # (a sum is NaN or infinite when a term is; logprobs are far too small to overflow one)
    if logprobs and not (math.isfinite(sum(logprobs)) and max(logprobs) <= MAX_LOGPROB):
        raise ValueError(f"logprobs must be finite and <= {MAX_LOGPROB}")
    versions = token_versions(meta.weight_versions, len(out.output_ids)) if meta.weight_versions else None
    return Generation(
        out.output_ids, logprobs, meta.finish_reason.type, meta.weight_version, out.text, versions
    )


def token_versions(spans: list, n: int) -> list[str]:
    """One version per output token from SGLang's `weight_versions` spans (`version`, `start`,
    `end`: tokens `[start, end)`). They must tile `[0, n)` in order, as
    `add_weight_versions_to_meta_info` writes them; anything else is a garbage answer (a
    token with a guessed version would break the staleness bound)."""
    out: list[str] = []
    for span in spans:
        if span.start != len(out) or span.end < span.start:
            raise ValueError(
                f"weight_versions spans do not tile the output: {span.start}..{span.end} at {len(out)}"
            )
        out += [span.version] * (span.end - span.start)
    if len(out) != n:
        raise ValueError(f"weight_versions cover {len(out)} tokens of {n}")
    return out


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
