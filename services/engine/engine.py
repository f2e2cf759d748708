"""The engine behind the HTTP routes: request validation, submission to the scheduler and
SGLang's response shapes for `/generate`, and the engine's lifecycle (start, stop, pausing the
scheduler, server info). Runs on the asyncio loop; the model lives on the scheduler thread
(`services/engine/scheduler.py`). `InferenceEngine` holds all the engine's state; the control
routes that change it are mixed in from their own modules: weight updates from
`services/engine/updates.py` (`WeightControlMixin`), LoRA loads and unloads from
`services/engine/adapters.py` (`AdapterControlMixin`), which also says which adapters are held
and when one may go."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.proto.sglang import (
    LORA_NOT_LOADED,
    SGLANG_RELEASE,
    GenerateItem,
    GenerateReqInput,
    SamplingParams,
    refused_by_reference_engine,
)
from asyncrl.services.engine import deltas, lora, metrics
from asyncrl.services.engine.adapters import AdapterControlMixin, AdapterRegistry
from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.engine.deltas import BroadcastChain, Loaded
from asyncrl.services.engine.model_runner import ModelRunner
from asyncrl.services.engine.sampling import RowSampling
from asyncrl.services.engine.scheduler import Request, Scheduler, version_spans
from asyncrl.services.engine.updates import WeightControlMixin, WeightUpdates
from asyncrl.services.runtime.cores import CoreShare, cpu_count

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
# Texts over context_length × this are refused before tokenizing (a 10 MB text held a CPU for
# seconds): BPE tokens average ~4 characters of real text and only runs of whitespace or
# punctuation reach dozens, so such a text cannot fit. A prompt made only of such runs could.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class _Params:
    """What every request with the same sampling params shares (`InferenceEngine._params`)."""

    refused: tuple[str, ...]  # what the reference engine does not support, as labels
    stop_ids: frozenset[int]
    sampling: RowSampling
    stop_strs: tuple[str, ...] = ()
    detokenize: Callable[[list[int]], str] | None = None


def _ignore(_: Request) -> None:
    """A request's `on_finish` until `_run` sets its own."""


class InvalidRequest(Exception):
    """A request the engine refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, reason: str = "invalid_input"):
        super().__init__(message)
        self.status = status
        self.reason = reason


class InferenceEngine(WeightControlMixin, AdapterControlMixin):
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.runner = ModelRunner(
            settings.model,
            slots=settings.max_running_requests,
            context_length=settings.context_length,
            device=settings.device,
            dtype=settings.dtype,
        )
        self.scheduler = Scheduler(
            self.runner,
            max_running=settings.max_running_requests,
            max_prefill_tokens=settings.max_prefill_tokens,
            weight_version=settings.weight_version,
            continuous_decode_steps=settings.num_continuous_decode_steps,
            logit_noise_std=settings.logit_noise_std,
            seed=settings.seed,
            cores=_core_share(settings),
            max_loras_per_batch=settings.max_loras_per_batch if settings.enable_lora else None,
        )
        # None: LoRA is off (`enable_lora`)
        self.adapters = (
            AdapterRegistry(max_loaded=settings.max_loaded_loras) if settings.enable_lora else None
        )
        self.groups: dict[str, object] = {}  # group_name → process group
        self.updates = WeightUpdates()
        # the published version directory the weights came from: the base a delta must name
        self.loaded: Loaded | None = deltas.loaded_of(settings.model)
        # the whole version broadcasts made the weights: the base a broadcast delta must name
        self.chain = BroadcastChain(self.runner.missing_weights)
        # SGLang 0.5.23's weight-update session: broadcast buckets are taken only inside one
        self.weight_session = False
        self._rng = random.Random(settings.seed)  # seeds requests that bring no sampling_seed
        self._in_flight: set[str] = set()
        metrics.set_weight_version(settings.weight_version)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    # --- generation -----------------------------------------------------------------------

    async def generate(self, body: GenerateReqInput) -> dict | list[dict]:
        if body.stream:
            raise InvalidRequest("stream=true is not supported by the reference engine; use stream=false")
        if body.batch_size > self.settings.max_batch_size:
            raise InvalidRequest(
                f"batch of {body.batch_size} prompts exceeds max_batch_size {self.settings.max_batch_size}; "
                "split it",
                reason="batch_too_large",
            )
        try:
            items = [body.item(i) for i in range(body.batch_size)]
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if body.is_batch and not items:
            raise InvalidRequest("empty batch")
        names = [item.lora_path for item in items]
        self._check_adapters(names)  # at once; `acquire` below, after the awaits, decides
        # id(sampling params) → what every item with them shares: a batch usually shares one object
        shared: dict[int, _Params] = {}
        for item in items:
            sp = item.sampling_params
            params = shared.get(id(sp)) or shared.setdefault(id(sp), self._params(sp))
            self._refuse_unsupported(item, params.refused)
        prompts = await self._prompt_ids(items)
        requests = [
            self._build(item, ids, shared[id(item.sampling_params)]) for item, ids in zip(items, prompts)
        ]  # all valid before any runs
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids) or self._in_flight.intersection(rids):
            raise InvalidRequest("duplicate rid: a request with this rid is already in flight")
        if self.scheduler.num_waiting + len(requests) > self.settings.max_queued_requests:
            raise InvalidRequest("engine queue is full; retry later", status=503, reason="queue_full")
        adapters = self._acquire_adapters(names)  # no await from here to the submission
        for r, adapter in zip(requests, adapters):
            r.adapter = adapter
        self._in_flight.update(rids)  # before any await, so a concurrent duplicate is refused
        try:
            await self._run(requests)
        finally:
            if self.adapters is not None:
                self.adapters.release(adapters)
        outputs = [self._response(r, item, body.return_text_in_logprobs) for r, item in zip(requests, items)]
        return outputs if body.is_batch else outputs[0]

    def _check_adapters(self, names: list[str | None]) -> None:
        """Refuse a request naming an adapter the engine does not hold (or LoRA when it is off)."""
        if not any(n is not None for n in names):
            return
        if self.adapters is None:
            first = next(n for n in names if n is not None)
            raise InvalidRequest(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
                "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.",
                reason="lora_disabled",
            )
        missing = self.adapters.missing(names)
        if missing:
            raise InvalidRequest(
                f"{LORA_NOT_LOADED}{', '.join(missing)}. "
                f"Loaded adapters: {sorted(self.adapters.loaded_paths())}.",
                reason="lora_not_loaded",
            )

    def _acquire_adapters(self, names: list[str | None]) -> list[lora.LoraAdapter | None]:
        """Each item's adapter, held for the request until `release`; refused as `_check_adapters`."""
        if self.adapters is None:
            return [None] * len(names)
        self._check_adapters(names)
        adapters = self.adapters.acquire(names)
        metrics.LORA_REQUESTS.inc(sum(a is not None for a in adapters))
        return adapters

    async def _run(self, requests: list[Request]) -> None:
        """Submit a request's items and wait until all have finished: one future and one wake-up
        of the event loop per request, not per item (a task, a shield and a thread-safe call
        per item were a third of this process's CPU in the demo)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        left = len(requests)
        lock = threading.Lock()

        def on_finish(_: Request) -> None:  # on the scheduler thread
            nonlocal left
            with lock:
                left -= 1
                last = left == 0
            if last:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        for req in requests:
            req.on_finish = on_finish
            self.scheduler.submit(req)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:  # the client went away: free the slots still held
            for req in requests:
                if req.finished_at is None:
                    self.scheduler.abort(req.rid, message="client disconnected")
            raise
        finally:
            self._in_flight.difference_update(r.rid for r in requests)

    async def _prompt_ids(self, items: list[GenerateItem]) -> list[list[int]]:
        """Each item's prompt ids. Texts are length-checked first, then tokenized in a thread:
        the event loop keeps answering /health while a long text is tokenized."""
        texts = [item.text or "" for item in items if item.input_ids is None]
        for text in texts:
            if not text:
                raise InvalidRequest("empty prompt")
            self.check_text_length(len(text))
        encoded = iter(())
        if texts:
            encoded = iter(await asyncio.to_thread(lambda: self.tokenizer(texts)["input_ids"]))
        return [list(item.input_ids) if item.input_ids is not None else next(encoded) for item in items]

    def check_text_length(self, chars: int) -> None:
        """Refuse a text that could not fit the context even at MAX_CHARS_PER_TOKEN per token."""
        context = self.runner.context_length
        if chars > context * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"text of {chars} characters cannot fit the context length {context} "
                f"(at most {MAX_CHARS_PER_TOKEN} characters per token)"
            )

    def _params(self, sp: SamplingParams) -> _Params:
        """What requests take from their sampling params, worked out once per params object."""
        stop = set(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            stop |= self.runner.eos_token_ids
        strs = stop_strings(sp)
        skip = sp.skip_special_tokens
        return _Params(
            self._unsupported(sp),
            frozenset(stop),
            RowSampling(sp.temperature, sp.top_p, sp.top_k, sp.min_p),
            strs,
            (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)) if strs else None,
        )

    def _build(self, item: GenerateItem, ids: list[int], shared: _Params) -> Request:
        sp = item.sampling_params
        if item.input_ids is not None:
            vocab = self.runner.vocab_size
            if min(ids, default=0) < 0 or max(ids, default=0) >= vocab:
                bad = [t for t in ids if not 0 <= t < vocab]
                raise InvalidRequest(f"input_ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if not ids:
            raise InvalidRequest("empty prompt")
        context = self.runner.context_length
        if len(ids) >= context:
            raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the context length {context}")
        if sp.max_new_tokens > self.settings.max_new_tokens_cap:
            raise InvalidRequest(
                f"max_new_tokens {sp.max_new_tokens} exceeds the cap {self.settings.max_new_tokens_cap}"
            )
        if item.logprob_start_len >= len(ids):
            raise InvalidRequest(
                f"logprob_start_len {item.logprob_start_len} must be below the prompt length {len(ids)}"
            )
        seed = sp.sampling_seed if sp.sampling_seed is not None else self._rng.getrandbits(63)
        max_new_tokens = min(sp.max_new_tokens, context - len(ids))
        return Request(
            rid=item.rid or f"{time.time_ns():x}{self._rng.getrandbits(32):08x}",
            prompt_ids=ids,
            # A request never outgrows the context: the remainder is clipped (finish "length").
            max_new_tokens=max_new_tokens,
            stop_ids=shared.stop_ids,
            sampling=shared.sampling,
            seed=seed,
            on_finish=_ignore,
            return_logprob=item.return_logprob,
            logprob_start_len=item.logprob_start_len,
            stop_strs=shared.stop_strs,
            detokenize=shared.detokenize,
        )

    @staticmethod
    def _unsupported(sp: SamplingParams) -> tuple[str, ...]:
        """Labels of what `sp` asks that the reference engine does not support."""
        return (*refused_by_reference_engine(sp).values(), *["n > 1"] * (sp.n != 1))

    @staticmethod
    def _refuse_unsupported(item: GenerateItem, unsupported: tuple[str, ...]) -> None:
        """`unsupported`: `_unsupported(item.sampling_params)`, worked out once per params object."""
        refused = [*unsupported, *["top_logprobs_num > 0"] * (item.top_logprobs_num > 0)]
        if refused:
            raise InvalidRequest(f"not supported by the reference engine: {', '.join(refused)}")

    def _response(self, r: Request, item: GenerateItem, text_in_logprobs: bool) -> dict:
        sp = item.sampling_params
        text_ids = r.output_ids
        matched = (
            (r.finish_reason or {}).get("matched") if (r.finish_reason or {}).get("type") == "stop" else None
        )
        trim = matched is not None and not sp.no_stop_trim
        if trim and isinstance(matched, int):
            text_ids = r.output_ids[:-1]  # SGLang trims the matched stop token from `text`
        spans = version_spans(r)
        meta: dict = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,  # shared prefill within one batch; no cache across batches
            "weight_version": spans[-1]["version"],  # the last token's, as SGLang reports it
            "weight_versions": spans,
            "e2e_latency": (r.finished_at or time.monotonic()) - r.submitted_at,
        }
        if r.return_logprob:
            decode = self._token_text if text_in_logprobs else (lambda t: None)
            meta["output_token_logprobs"] = [
                [lp, t, decode(t)] for lp, t in zip(r.output_logprobs, r.output_ids)
            ]
            start = max(r.logprob_start_len, 0)
            meta["input_token_logprobs"] = [
                [lp, t, decode(t)] for lp, t in zip(r.input_logprobs or [], r.prompt_ids[start:])
            ]
        return {
            "text": _cut_at(
                self.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens),
                matched if trim and isinstance(matched, str) else None,
            ),
            "output_ids": list(r.output_ids),
            "meta_info": meta,
        }

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def health_generate(self) -> bool:
        probe = GenerateReqInput(
            input_ids=[self.tokenizer.bos_token_id or 0],
            sampling_params={"max_new_tokens": 1, "temperature": 0},
        )
        try:
            await asyncio.wait_for(self.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return False
        return True

    # --- control --------------------------------------------------------------------------

    async def on_scheduler(self, fn, *, drain: bool = False):
        return await asyncio.wrap_future(self.scheduler.call(fn, drain=drain))

    def server_info(self) -> dict:
        return {
            **self.settings.model_dump(mode="json"),
            "context_length": self.runner.context_length,
            "weight_version": self.weight_version,
            "internal_states": [
                {
                    **self.scheduler.stats,
                    "num_running_reqs": self.scheduler.num_running,
                    "num_waiting_reqs": self.scheduler.num_waiting,
                    "paused": self.scheduler.paused,
                }
            ],
            "weight_updates": self.updates.state(),
            # LoRA adapters held, least recently used first (None: LoRA off)
            "lora_adapters": self.adapters.state() if self.adapters is not None else None,
            # The release tag of the API it follows; the rollout's `engine_kind` tells the
            # reference engine by this key.
            "sglang_api_commit": f"v{SGLANG_RELEASE}",
        }


def stop_strings(sp: SamplingParams) -> tuple[str, ...]:
    """SGLang's `stop` (a string or a list of them) as a tuple; empty strings mean nothing."""
    raw = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    return tuple(s for s in raw if s)


def _cut_at(text: str, stop: str | None) -> str:
    """`text` before the stop string it ended with, as SGLang trims it (the tokens stay)."""
    if stop is None:
        return text
    at = text.find(stop)
    return text[:at] if at >= 0 else text


def _core_share(settings: EngineSettings) -> CoreShare | None:
    if settings.core_share is None:
        return None
    return CoreShare(
        settings.core_share,
        "engine",
        home=settings.num_threads,
        total=max(settings.core_share_threads or cpu_count(), settings.num_threads),
    )
