"""The engine behind the HTTP routes: request validation, submission to the scheduler, SGLang
response shapes, weight updates and LoRA adapters. Runs on the asyncio loop; the model lives on
the scheduler thread (`services/engine/scheduler.py`). Weight updates run one at a time, each
within a deadline, their blocking parts on threads of their own (`services/engine/updates.py`);
disk updates and adapters load only directories inside `weights_root`. Which adapters are held
and when one may go: `services/engine/adapters.py`."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.proto.sglang import (
    LORA_NOT_LOADED,
    SGLANG_RELEASE,
    GenerateItem,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    ReferenceUpdateWeightsFromDistributedReqInput,
    SamplingParams,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    refused_by_reference_engine,
)
from asyncrl.services.engine import deltas, lora, metrics
from asyncrl.services.engine.adapters import AdapterRegistry
from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.engine.deltas import BroadcastChain, Loaded
from asyncrl.services.engine.model_runner import ModelRunner, read_checkpoint
from asyncrl.services.engine.sampling import RowSampling
from asyncrl.services.engine.scheduler import Request, Scheduler, version_spans
from asyncrl.services.engine.updates import UpdateBusy, UpdateTimeout, WeightUpdates, in_thread
from asyncrl.services.runtime.cores import CoreShare, cpu_count
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.transport.weights import broadcast as weight_broadcast
from asyncrl.services.transport.weights.delta import DeltaError, is_delta_dir, tensor_sha256
from asyncrl.services.transport.weights.filesystem import WEIGHTS_GLOB

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
# Texts over context_length × this are refused before tokenizing (a 10 MB text held a CPU for
# seconds): BPE tokens average ~4 characters of real text and only runs of whitespace or
# punctuation reach dozens, so such a text cannot fit. A prompt made only of such runs could.
MAX_CHARS_PER_TOKEN = 64
# One answer for every model_path refused (relative, outside weights_root once symlinks and '..'
# are resolved, missing, not a directory, no *.safetensors): the answer must not tell a caller
# what exists on the engine's file system.
REFUSED_PATH = "model_path refused: not a directory of *.safetensors files inside the engine's weights_root"
# The rendezvous gets the time left of its turn; the caller waits this much longer, so that the
# library's own timeout (a clean error) normally comes first and ours is the backstop.
JOIN_GRACE_S = 2.0
NOT_APPLIED_IN_TIME = "the engine did not reach a point to apply the weights in time"
# SGLang 0.5.23's answers (scheduler_components/weight_updater.py), word for word
OUTSIDE_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
# SGLang 0.5.23's LoRA answers (managers/tokenizer_control_mixin.py, tokenizer_manager.py), word for word
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# One answer for every lora_path refused, as REFUSED_PATH for weights.
REFUSED_ADAPTER_PATH = (
    "lora_path refused: not a directory with adapter_config.json and adapter_model.safetensors "
    "inside the engine's weights_root"
)


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


@dataclass(frozen=True)
class UpdateResult:
    ok: bool
    message: str
    # HTTP status: 200, 400 (refused or failed), 409 (a join under way; a broadcast delta that
    # needs a full version), 503 (busy)
    status: int
    num_paused_requests: int = 0


@dataclass(frozen=True)
class LoraResult:
    """What `/load_lora_adapter` and `/unload_lora_adapter` answer (SGLang's `LoRAUpdateOutput`):
    `loaded_adapters` None when refused before reaching the adapters, as SGLang does."""

    ok: bool
    error_message: str
    status: int  # 200, or 400 (SGLang's status for every failed LoRA update)
    loaded_adapters: dict[str, str] | None = None


def resolve_weights_dir(root: str, path: str) -> str | None:
    """The real path of checkpoint directory `path` when it lies inside `root` (both resolved:
    symlinks, '..') and holds *.safetensors files that resolve inside `root` too; else None."""
    if not os.path.isabs(path):
        return None
    try:
        real_root, real = os.path.realpath(root), os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root or not os.path.isdir(real):
            return None
        files = glob.glob(os.path.join(glob.escape(real), WEIGHTS_GLOB))
        inside = [os.path.commonpath([real_root, os.path.realpath(f)]) == real_root for f in files]
    except (OSError, ValueError):  # a NUL byte in the path, an unreadable directory
        return None
    return real if files and all(inside) else None


class InferenceEngine:
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

    async def update_weights_from_disk(self, req: UpdateWeightFromDiskReqInput) -> UpdateResult:
        root = self.settings.weights_root
        if root is None:
            self.updates.record("disk", "refused")
            return UpdateResult(
                False, "update_weights_from_disk is disabled: the engine has no weights_root", 400
            )

        loaded = self.loaded

        def read() -> tuple[dict[str, torch.Tensor], bool, Loaded | None] | None:
            """(tensors, whether they cover the whole model, the version they make)."""
            real = resolve_weights_dir(root, req.model_path)
            if real is None:
                return None
            if is_delta_dir(real):
                return deltas.rebuild(
                    real,
                    loaded,
                    self.runner.model.state_dict,
                    lambda p: resolve_weights_dir(root, p),
                )
            return read_checkpoint(real), True, deltas.loaded_of(real)

        try:
            async with self.updates.turn("disk", self.settings.weight_update_timeout_s) as deadline:
                try:
                    got = await in_thread(read, deadline, "weights-read")
                except UpdateTimeout:
                    return self._failed("disk", "timeout", "reading the checkpoint timed out")
                except DeltaError as exc:  # the delta and its resync both failed: weights kept
                    return self._failed("disk", "error", f"delta refused ({exc.reason}): {exc}")
                except (OSError, ValueError) as exc:  # a corrupt or unreadable file inside the root
                    return self._failed("disk", "error", f"cannot read the checkpoint: {exc}")
                if got is None:
                    self.updates.record("disk", "refused")
                    return UpdateResult(False, REFUSED_PATH, 400)
                named, whole, made = got
                error = self.runner.check_weights(named, full=whole)
                if error:
                    return self._failed("disk", "error", error)
                if req.abort_all_requests:
                    self.scheduler.abort(abort_all=True, message="aborted for a weight update")
                self.loaded = None  # until the copy is done: a timed-out one may be half applied
                self.chain.clear()
                retracted = await self._set_weights(named, req.weight_version, deadline)
                self.loaded = made
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        except UpdateTimeout:
            return self._failed("disk", "timeout", NOT_APPLIED_IN_TIME)
        self.updates.record("disk", "ok")
        log_event(log, "weights updated from disk", path=req.model_path, version=self.weight_version)
        return UpdateResult(True, f"Succeeded to update model weights from {req.model_path}.", 200, retracted)

    async def init_weights_update_group(self, req: InitWeightsUpdateGroupReqInput) -> UpdateResult:
        if req.group_name in self.groups:
            self.updates.record("group", "refused")
            return UpdateResult(False, f"group {req.group_name!r} already exists", 400)
        if req.backend == "nccl" and self.runner.device.type != "cuda":
            self.updates.record("group", "refused")
            return UpdateResult(
                False, "backend nccl needs a CUDA device; this engine runs on CPU (use gloo)", 400
            )
        if self.updates.joining:
            self.updates.record("group", "busy")
            return UpdateResult(False, "another init_weights_update_group is under way; retry after it", 409)
        self.updates.joining = True
        try:
            async with self.updates.turn("group", self.settings.weight_group_timeout_s) as deadline:

                def join():
                    return weight_broadcast.init_weight_update_group(
                        req.master_address,
                        req.master_port,
                        req.rank_offset,
                        req.world_size,
                        req.group_name,
                        req.backend,
                        timeout_s=max(deadline - time.monotonic(), 0.1),
                    )

                try:
                    group = await in_thread(join, deadline + JOIN_GRACE_S, "weights-join")
                except UpdateTimeout:
                    return self._failed(
                        "group",
                        "timeout",
                        f"joining {req.group_name!r} timed out "
                        f"after {self.settings.weight_group_timeout_s:g} s",
                    )
                # a rendezvous timeout, a refused connection, a bad backend
                except (RuntimeError, ValueError) as exc:
                    return self._failed("group", "error", f"failed to join {req.group_name!r}: {exc}")
                self.groups[req.group_name] = group
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        finally:
            self.updates.joining = False
        self.updates.record("group", "ok")
        log_event(
            log,
            "joined weight update group",
            group=req.group_name,
            rank=req.rank_offset,
            world=req.world_size,
        )
        return UpdateResult(
            True, f"Joined weight update group {req.group_name!r} as rank {req.rank_offset}.", 200
        )

    async def update_weights_from_distributed(
        self, req: ReferenceUpdateWeightsFromDistributedReqInput
    ) -> UpdateResult:
        try:
            dtypes = [weight_broadcast.parse_dtype(d) for d in req.dtypes]
        except ValueError as exc:
            self.updates.record("distributed", "refused")
            return UpdateResult(False, str(exc), 400)
        try:
            async with self.updates.turn("distributed", self.settings.weight_update_timeout_s) as deadline:
                group = self.groups.get(req.group_name)
                if group is None:
                    self.updates.record("distributed", "refused")
                    return UpdateResult(
                        False,
                        f"no weight update group {req.group_name!r}; call /init_weights_update_group first",
                        400,
                    )
                if req.abort_all_requests:
                    self.scheduler.abort(abort_all=True, message="aborted for a weight update")
                device = "cpu" if isinstance(group, dist.ProcessGroupGloo) else self.runner.device

                def receive() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
                    got = weight_broadcast.receive_bucket(group, req.names, dtypes, req.shapes, device)
                    # a delta's hashes here, off the event loop
                    return got, {n: tensor_sha256(t) for n, t in got.items()} if req.delta else {}

                try:
                    received, digests = await in_thread(receive, deadline, "weights-receive")
                except (UpdateTimeout, RuntimeError) as exc:
                    # The sender and this engine no longer agree on where the stream is: the group
                    # is dropped, and the trainer joins a new one (a fresh name per start).
                    self.groups.pop(req.group_name, None)
                    self.chain.clear()
                    result = "timeout" if isinstance(exc, UpdateTimeout) else "error"
                    return self._failed(
                        "distributed",
                        result,
                        f"receiving from {req.group_name!r} failed ({exc}); group dropped",
                    )
                # Every tensor was received before these checks, so the sender is never left blocked.
                if not self.weight_session:
                    self.updates.record("distributed", "refused")
                    return UpdateResult(False, OUTSIDE_SESSION, 400)
                error = self.runner.check_weights(received, full=False)
                if error:
                    return self._failed("distributed", "error", error)
                if req.delta is not None:
                    refused = self._refuse_delta(req, digests)
                    if refused is not None:
                        return refused
                self.loaded = None  # no longer the weights of a published directory
                base = None if req.delta is None else req.delta.base
                self.chain.applying(req.group_name, base, req.names)
                await self._set_weights(received, req.weight_version, deadline)
                outcome = self.chain.applied(req.group_name, req.weight_version)
                if outcome is not None:
                    metrics.WEIGHT_DELTAS.labels(result=outcome).inc()
        except UpdateBusy as exc:
            return UpdateResult(False, str(exc), 503)
        except UpdateTimeout:
            self.chain.clear()  # the copy may have been under way
            return self._failed("distributed", "timeout", NOT_APPLIED_IN_TIME)
        self.updates.record("distributed", "ok")
        log_event(log, "weights updated from broadcast", count=len(req.names), version=self.weight_version)
        return UpdateResult(True, f"Succeeded to update {len(received)} parameters.", 200)

    def begin_weight_update(self) -> UpdateResult:
        """Open the weight-update session (SGLang restores packed weights here; this engine keeps
        none, so only the session's state is kept). One at a time, as in SGLang."""
        if self.weight_session:
            self.updates.record("session", "refused")
            return UpdateResult(
                False, "a weight-update session is already open; call end_weight_update() first", 400
            )
        self.weight_session = True
        return UpdateResult(True, "Success", 200)

    def end_weight_update(self) -> UpdateResult:
        if not self.weight_session:
            self.updates.record("session", "refused")
            return UpdateResult(False, NO_SESSION, 400)
        self.weight_session = False
        return UpdateResult(True, "Success", 200)

    def _refuse_delta(
        self, req: ReferenceUpdateWeightsFromDistributedReqInput, digests: dict[str, str]
    ) -> UpdateResult | None:
        """The answer to a delta bucket that must not be applied (every tensor of it received
        already, each hashed to `digests`), counted; None to apply it. A 409 asks the sender
        for a full version."""
        assert req.delta is not None
        if set(req.delta.sha256) != set(req.names):
            self.updates.record("distributed", "refused")
            return UpdateResult(False, "a delta bucket needs one sha256 per name, and only those", 400)
        refused = self.chain.refusal(req.group_name, req.delta.base, req.delta.sha256, digests)
        if refused is None:
            return None
        reason, message = refused
        metrics.WEIGHT_RESYNCS.labels(reason=reason).inc()
        if reason == "hash":  # bytes that changed on the way: a failure, even if a resync follows
            self.updates.record("distributed", "error", message)
        else:  # nothing was applied: the weights are what they were
            self.updates.record("distributed", "refused")
        log_event(log, "broadcast delta refused", logging.WARNING, reason=reason, message=message)
        return UpdateResult(False, f"{message} (serving weight_version {self.weight_version!r})", 409)

    async def _set_weights(self, named: dict[str, torch.Tensor], weight_version: str | None, deadline: float):
        """Install `named` as `weight_version` (`_apply`: between scheduler steps, by `deadline`)."""
        return await self._apply(
            lambda: self.scheduler.set_weights(lambda: self.runner.apply_weights(named), weight_version),
            deadline,
        )

    async def _apply(self, fn, deadline: float):
        """`fn()` on the scheduler thread once running requests are drained (unless paused), by
        `deadline`. Past it, a call not yet started is withdrawn (`UpdateTimeout`); one already
        started (a weight copy) is awaited: withdrawing it would leave half-copied weights."""
        call = self.scheduler.call(fn, drain=True)
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(call)), max(deadline - time.monotonic(), 0.0)
            )
        except TimeoutError:
            if call.cancel():
                raise UpdateTimeout("the scheduler did not take the update in time") from None
            return await asyncio.wrap_future(call)

    def _failed(self, source: str, result: str, message: str) -> UpdateResult:
        self.updates.record(source, result, message)
        log_event(log, "weight update failed", logging.WARNING, source=source, result=result, message=message)
        return UpdateResult(False, message, 400)

    # --- LoRA adapters --------------------------------------------------------------------

    async def load_lora_adapter(self, req: LoadLoRAAdapterReqInput) -> LoraResult:
        """Read, check and register an adapter; past `max_loaded_loras`, evict the least
        recently used one that no request uses and is not pinned (`adapters.py`), or refuse."""
        registry = self.adapters
        if registry is None:
            return self._lora_refused("load", LORA_DISABLED)
        root = self.settings.weights_root
        if root is None:
            return self._lora_refused("load", "load_lora_adapter is disabled: the engine has no weights_root")
        name = req.lora_name
        async with registry.lock:
            if registry.is_leaving(name):
                return self._lora_refused(
                    "load",
                    f"LoRA adapter '{name}' is being unloaded: requests in flight still use it. "
                    "Load it again once its unload has returned.",
                )
            if registry.is_loaded(name):
                return self._lora_refused(
                    "load", f"Failed to load LoRA adapter {name} because it is already loaded", listed=True
                )
            if req.pinned and registry.num_pinned >= self.settings.max_loras_per_batch - 1:
                return self._lora_refused(
                    "load",
                    f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all "
                    "slots in the LoRA memory pool to avoid starvation for unpinned adapters and base models. "
                    "Please increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters.",
                    listed=True,
                )
            if registry.room_needed() and registry.victim() is None:
                return self._lora_refused("load", self._no_room(name))

            def read() -> lora.LoraAdapter | None:
                real = lora.resolve_adapter_dir(root, req.lora_path)
                if real is None:
                    return None
                return lora.read_adapter(
                    name,
                    req.lora_path,
                    real_path=real,
                    linears=self.runner.lora_linears,
                    max_rank=self.settings.max_lora_rank,  # type: ignore[arg-type]  # set with enable_lora
                    allowed=self.settings.lora_targets,
                    vocab_size=self.runner.vocab_size,
                    dtype=self.runner.dtype,
                    device=self.runner.device,
                    pinned=req.pinned,
                )

            deadline = time.monotonic() + self.settings.weight_update_timeout_s
            try:
                adapter = await in_thread(read, deadline, "lora-read")
            except UpdateTimeout:
                return self._lora_failed(name, "timeout", f"reading LoRA adapter {name} timed out")
            except lora.AdapterError as exc:
                return self._lora_failed(name, "error", str(exc))
            if adapter is None:
                return self._lora_refused("load", REFUSED_ADAPTER_PATH, listed=True)
            if registry.room_needed():
                victim = registry.victim()  # requests may have started using the one seen above
                if victim is None:
                    return self._lora_refused("load", self._no_room(name))
                registry.evict(victim)
                metrics.LORA_UPDATES.labels(operation="evict", result="ok").inc()
                log_event(log, "LoRA adapter evicted", name=victim, for_adapter=name)
            registry.add(adapter)
            metrics.LORA_ADAPTERS.set(len(registry.loaded_paths()))
        metrics.LORA_UPDATES.labels(operation="load", result="ok").inc()
        log_event(log, "LoRA adapter loaded", name=name, path=req.lora_path, rank=adapter.rank)
        return LoraResult(True, "", 200, registry.loaded_paths())

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterReqInput) -> LoraResult:
        """Hide the adapter from new requests at once, and answer once the requests in flight
        that use it have ended and it is gone (SGLang's order)."""
        registry = self.adapters
        if registry is None:
            return self._lora_refused("unload", LORA_DISABLED)
        name = req.lora_name
        async with registry.lock:
            if not registry.is_loaded(name) and not registry.is_leaving(name):
                return self._lora_refused(
                    "unload",
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {list(registry.loaded_paths())}",
                )
            gone = registry.unregister(name)
            metrics.LORA_ADAPTERS.set(len(registry.loaded_paths()))
        await gone.wait()  # outside the lock: other loads and unloads go on meanwhile
        metrics.LORA_UPDATES.labels(operation="unload", result="ok").inc()
        log_event(log, "LoRA adapter unloaded", name=name)
        return LoraResult(True, "", 200, registry.loaded_paths())

    def _no_room(self, name: str) -> str:
        return (
            f"cannot load LoRA adapter {name}: all {self.settings.max_loaded_loras} loaded adapters "
            "(max_loaded_loras) are in use by requests in flight or pinned; unload one, or retry once "
            "their requests have ended"
        )

    def _lora_refused(self, operation: str, message: str, *, listed: bool = False) -> LoraResult:
        """Refused before any adapter was read or changed. `listed`: answer with the adapters
        loaded, as SGLang does for what its LoRA manager refuses (not for what its tokenizer
        manager refuses first: LoRA off, an unload under way, no room, an unknown unload)."""
        metrics.LORA_UPDATES.labels(operation=operation, result="refused").inc()
        log_event(log, "LoRA update refused", logging.WARNING, operation=operation, message=message)
        loaded = self.adapters.loaded_paths() if listed and self.adapters is not None else None
        return LoraResult(False, message, 400, loaded)

    def _lora_failed(self, name: str, result: str, message: str) -> LoraResult:
        """A load whose adapter could not be read or does not fit the model: nothing changed."""
        metrics.LORA_UPDATES.labels(operation="load", result=result).inc()
        log_event(log, "LoRA adapter load failed", logging.WARNING, name=name, message=message)
        return LoraResult(False, message, 400, self.adapters.loaded_paths() if self.adapters else None)

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
