"""The service's state and the calls its routes make: accept a call into the command log (or
refuse it, naming why), answer a future, run a sample. Routes only parse and answer.

Limits, each a clear refusal rather than memory growth: `max_models` models at once (429),
`max_queued_commands` per model (429), `max_inflight_samples` (429), `max_tokens_per_call`
per forward/forward_backward and per sample prompt (400), `max_samples_per_call` (400), request
bodies (413, by `BodyLimit`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException

from asyncrl.proto import tinker as wire
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.tinker import metrics as m
from asyncrl.services.tinker.commands import (
    DONE,
    FAILED,
    CommandLog,
    ModelGone,
    QueueFull,
    SeqBehind,
    SeqConflict,
    fingerprint,
)
from asyncrl.services.tinker.config import TinkerServiceSettings
from asyncrl.services.tinker.paths import check_name, model_id, sampling_session_id
from asyncrl.services.tinker.sampling import EngineError, Sampler, SampleRefused
from asyncrl.services.tinker.worker import MAX_ERROR_CHARS, TrainingWorker, arrays_to_json

log = logging.getLogger(__name__)

SEED_RANGE = 1 << 31  # a model created without a seed gets one, stored, so a restart rebuilds it the same


class Waiters:
    """Futures' completion signals, for `retrieve_future`'s long poll. A poll watches its request
    id before it reads the record (`watch`), so a call finishing between that read and the wait
    still wakes it; `notify` may come from any thread and touches the watchers on the loop only."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: dict[str, set[asyncio.Event]] = {}

    def notify(self, rid: str) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, rid)

    def _wake(self, rid: str) -> None:
        for event in self.events.get(rid, ()):
            event.set()

    @contextmanager
    def watch(self, rid: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self.events.setdefault(rid, set()).add(event)
        try:
            yield event
        finally:
            watchers = self.events.get(rid, set())
            watchers.discard(event)
            if not watchers:
                self.events.pop(rid, None)


def refuse(status: int, route: str, message: str) -> HTTPException:
    m.REQUESTS.labels(route, "limited" if status in (429, 503, 413) else "refused").inc()
    return HTTPException(status_code=status, detail=message)


class TinkerService:
    def __init__(self, settings: TinkerServiceSettings, commands: CommandLog, backend: Any, api: Any):
        self.settings, self.log, self.backend = settings, commands, backend
        self.waiters = Waiters()
        self.worker = TrainingWorker(
            commands,
            backend,
            gap_timeout_s=settings.gap_timeout_s,
            notify=self.waiters.notify,
            tinker_module=api,
            session_timeout_s=settings.session_timeout_s,
        )
        self.sampler = Sampler(
            settings.engine_urls,
            timeout_s=settings.engine_timeout_s,
            max_loaded=settings.max_loaded_adapters,
            max_tokens=settings.max_sample_tokens,
        )
        self.samples: dict[str, asyncio.Task] = {}  # running sample calls by request id
        self._create_lock = threading.Lock()

    # --- accepting commands ------------------------------------------------------------------

    def submit(
        self, route: str, mid: str, seq: int | None, kind: str, payload: dict, raw: bytes
    ) -> wire.UntypedFuture:
        """Queue command `seq` of `mid` (or find it, if this call was seen) and wake the worker."""
        record = self.log.model(mid)
        if record is None:
            raise refuse(404, route, f"unknown model_id {mid[:128]!r}")
        if record.get("status") == "lost":
            raise refuse(410, route, record.get("lost_reason", f"model {mid} is gone"))
        if record.get("status") == "failed":
            raise refuse(400, route, f"model {mid} was never created: {record.get('failed_reason')}")
        if record.get("status") != "live":
            raise refuse(404, route, f"model {mid} is {record.get('status')}")
        if seq is None or seq < 1:
            raise refuse(
                400, route, f"{kind} needs a seq_id of 1 or more (the SDK numbers a model's calls from 1)"
            )
        return self._queue(route, mid, seq, kind, payload, raw)

    def _queue(
        self, route: str, mid: str, seq: int, kind: str, payload: dict, raw: bytes, model: dict | None = None
    ):
        try:
            rid, created = self.log.submit(mid, seq, kind, payload, fingerprint(raw), model=model)
        except (SeqConflict, SeqBehind) as exc:
            raise refuse(400, route, str(exc)) from None
        except QueueFull as exc:
            raise refuse(429, route, str(exc)) from None
        except ModelGone as exc:
            raise refuse(404, route, str(exc)) from None
        m.REQUESTS.labels(route, "accepted" if created else "retried").inc()
        self.worker.wake()
        return wire.UntypedFuture(request_id=rid, model_id=mid)

    def create_model(self, body: wire.CreateModelRequest, raw: bytes) -> wire.UntypedFuture:
        route = "create_model"
        self._open_session(route, body.session_id)
        if body.base_model not in self.settings.base_models:
            raise refuse(
                400,
                route,
                f"base_model {body.base_model[:128]!r} is not served here; served: {sorted(self.settings.base_models)}",
            )
        if body.lora_config is None:
            raise refuse(
                400, route, "full fine-tuning (no lora_config) is not supported: create a LoRA model"
            )
        if body.optimizer_config.type != "adamw":
            raise refuse(400, route, f"optimizer {body.optimizer_config.type!r} is not supported: only adamw")
        if body.lora_config.rank > self.settings.max_lora_rank:
            raise refuse(
                400,
                route,
                f"LoRA rank {body.lora_config.rank} is above max_lora_rank ({self.settings.max_lora_rank})",
            )
        mid = model_id(body.session_id, body.model_seq_id)
        lora = body.lora_config.model_dump()
        seed = lora["seed"] if lora["seed"] is not None else random.randrange(SEED_RANGE)
        record = {
            "status": "live", "session": body.session_id, "base_model": body.base_model, "lora": lora,
            "seed": seed, "cursor": -1, "created": time.time(), "origin_checkpoint": None,
        }  # fmt: skip
        return self._create(
            route,
            mid,
            "create_model",
            {"base_model": body.base_model, "lora": lora, "seed": seed},
            raw,
            record,
        )

    def create_from_checkpoint(self, body: wire.LoadWeightsRequest, raw: bytes) -> wire.UntypedFuture:
        """`load_weights` as a model's first call (create-via-load: seq id 0, no create_model)."""
        route = "load_weights"
        self._open_session(route, body.session_id or "")
        checkpoint = self.log.record("ckpt", body.path)
        if checkpoint is None or checkpoint.get("kind") != "training":
            raise refuse(
                404, route, f"no training checkpoint named {body.path[:200]!r} (save_state writes them)"
            )
        mid = model_id(body.session_id, body.model_seq_id or 0)
        # The origin keeps the checkpoint's own seq id (`recovery._rebuild` checks it) and whether
        # the optimizer state was loaded with it.
        record = {
            "status": "live", "session": body.session_id, "base_model": checkpoint["base_model"],
            "lora": checkpoint["lora"], "seed": random.randrange(SEED_RANGE), "cursor": -1, "created": time.time(),
            "origin_checkpoint": {"path": body.path, **checkpoint, "optimizer": body.optimizer},
        }  # fmt: skip
        payload = {"path": body.path, "optimizer": body.optimizer}
        return self._create(route, mid, "load_weights", payload, raw, record)

    def _open_session(self, route: str, sid: str) -> None:
        """Refuse a model in a session that is unknown (404) or finished (410: its models are
        released, a new one would be too)."""
        session = self.log.session(sid)
        if session is None:
            raise refuse(404, route, f"unknown session_id {sid[:64]!r}: create_session first")
        if "finished" in session:
            raise refuse(410, route, f"session {sid} is finished ({session['finished']}): create a new one")

    def _create(
        self, route: str, mid: str, kind: str, payload: dict, raw: bytes, record: dict
    ) -> wire.UntypedFuture:
        with self._create_lock:
            existing = self.log.model(mid)
            if existing is None:
                live = len(self.log.live_models())
                if live >= self.settings.max_models:
                    raise refuse(
                        429, route, f"this service holds {live} models (max_models = {self.settings.max_models}); "
                        "finish a session (ServiceClient.close) to free one"
                    )  # fmt: skip
                return self._queue(route, mid, 0, kind, payload, raw, model=record)
        return self._queue(route, mid, 0, kind, payload, raw)

    def forward_backward(self, call: wire.ForwardBackwardCall, raw: bytes) -> wire.UntypedFuture:
        route = "forward" if call.forward_only else "forward_backward"
        if call.loss_fn not in wire.SDK_LOSS_FNS:
            raise refuse(
                400,
                route,
                f"loss_fn {call.loss_fn[:64]!r} is not one of the SDK's: {', '.join(wire.SDK_LOSS_FNS)}",
            )
        if call.loss_fn == "custom":
            raise refuse(400, route, "server-side custom losses (create_custom_loss) are not supported; "
                         "forward_backward_custom with a Python callable runs client-side and works")  # fmt: skip
        if not call.data:
            raise refuse(400, route, "no data")
        tokens = sum(len(d.tokens) for d in call.data)
        if tokens > self.settings.max_tokens_per_call:
            raise refuse(
                400,
                route,
                f"{tokens} tokens in one call; max_tokens_per_call is {self.settings.max_tokens_per_call}: send fewer datums per call",
            )
        payload = {
            "loss_fn": call.loss_fn,
            "loss_fn_config": call.loss_fn_config or None,
            "data": [{"tokens": d.tokens, "inputs": arrays_to_json(d.inputs)} for d in call.data],
        }
        kind = "forward" if call.forward_only else "forward_backward"
        return self.submit(route, call.model_id, call.seq_id, kind, payload, raw)

    def optim_step(self, body: wire.OptimStepRequest, raw: bytes) -> wire.UntypedFuture:
        params = body.adam_params or body.optim_params
        if params is None or (params.type not in (None, "adamw", "adam")):
            kind = (body.optimizer_params or {}).get("type") or (params.type if params else None)
            raise refuse(
                400, "optim_step", f"optimizer params of type {kind!r} are not supported: only AdamParams"
            )
        adam = params.model_dump(exclude={"type"})
        return self.submit("optim_step", body.model_id, body.seq_id, "optim_step", {"adam": adam}, raw)

    def save_weights(self, body: wire.SaveWeightsRequest, raw: bytes) -> wire.UntypedFuture:
        name = self._name("save_weights", body.path)
        return self.submit("save_weights", body.model_id, body.seq_id, "save_weights", {"name": name}, raw)

    def save_weights_for_sampler(
        self, body: wire.SaveWeightsForSamplerRequest, raw: bytes
    ) -> wire.UntypedFuture:
        route = "save_weights_for_sampler"
        if body.kind != "snapshot":
            raise refuse(
                400, route, f"sampler weights of kind {body.kind!r} are not supported: only snapshot"
            )
        name = self._name(route, body.path)
        payload = {"name": name, "sampling_session_seq_id": body.sampling_session_seq_id}
        # The SDK draws sampling_session_seq_id anew each time its retry loop resends the call
        # (training_client.py `_save_weights_for_sampler_impl`), so the call is the rest of the
        # body: a resend gets the first send's future, whose result names the first session.
        identity = body.model_dump_json(exclude={"sampling_session_seq_id"}).encode()
        return self.submit(route, body.model_id, body.seq_id, route, payload, identity)

    def load_weights(self, body: wire.LoadWeightsRequest, raw: bytes) -> wire.UntypedFuture:
        if body.weights_access_token:
            raise refuse(
                400, "load_weights", "weights_access_token (another account's checkpoints) is not supported"
            )
        if body.session_id is not None:
            return self.create_from_checkpoint(body, raw)
        if body.model_id is None:
            raise refuse(
                400, "load_weights", "load_weights needs a model_id, or a session_id and model_seq_id"
            )
        payload = {"path": body.path, "optimizer": body.optimizer}
        return self.submit("load_weights", body.model_id, body.seq_id, "load_weights", payload, raw)

    def _name(self, route: str, name: str | None) -> str | None:
        try:
            return check_name(name)
        except ValueError as exc:
            raise refuse(400, route, str(exc)) from None

    # --- sessions, models, samplers ------------------------------------------------------------

    def finish_session(self, sid: str, reason: str) -> None:
        if not self.log.finish_session(sid, reason):
            raise refuse(404, "finish_session", f"unknown session_id {sid[:64]!r}")
        mids = [mid for mid in self.log.live_models() if (self.log.model(mid) or {}).get("session") == sid]
        self.worker.wake()  # it releases them once their queues are empty
        log_event(log, "session finished", session=sid, reason=reason, models=len(mids))

    def info(self, mid: str) -> wire.GetInfoResponse:
        record = self.log.model(mid)
        if record is None or record.get("info") is None:
            raise refuse(404, "get_info", f"unknown model_id {mid[:128]!r} (or not created yet)")
        info = record["info"]
        return wire.GetInfoResponse(
            model_data=wire.ModelData(
                arch=info.get("arch"),
                model_name=record["base_model"],
                tokenizer_id=info.get("tokenizer_path"),
            ),
            model_id=mid,
            is_lora=True,
            lora_rank=record["lora"]["rank"],
            model_name=record["base_model"],
        )

    def create_sampling_session(self, body: wire.CreateSamplingSessionRequest) -> str:
        route = "create_sampling_session"
        if self.log.session(body.session_id) is None:
            raise refuse(404, route, f"unknown session_id {body.session_id[:64]!r}")
        sid = sampling_session_id(body.session_id, body.sampling_session_seq_id)
        if body.model_path:
            record = self.log.record("ckpt", body.model_path)
            if record is None or record.get("kind") != "sampler":
                raise refuse(
                    404,
                    route,
                    f"no sampler weights named {body.model_path[:200]!r} (save_weights_for_sampler writes them)",
                )
            session = {**record, "model_path": body.model_path}
        elif body.base_model in self.settings.base_models:
            session = {
                "kind": "base",
                "base_model": body.base_model,
                "adapter_name": None,
                "model_path": None,
            }
        else:
            raise refuse(400, route, f"base_model {str(body.base_model)[:128]!r} is not served here")
        self.log.put_record("sampler", sid, session)
        return sid

    def sampler_info(self, sid: str) -> wire.SamplerInfo:
        session = self.log.record("sampler", sid)
        if session is None:
            raise refuse(404, "samplers", f"unknown sampling session {sid[:128]!r}")
        return wire.SamplerInfo(
            sampler_id=sid, base_model=session["base_model"], model_path=session.get("model_path")
        )

    # --- samples --------------------------------------------------------------------------------

    def start_sample(self, body: wire.SampleRequest) -> wire.UntypedFuture:
        route = "asample"
        if body.sampling_session_id is None:
            raise refuse(400, route, "asample needs a sampling_session_id (create_sampling_session)")
        session = self.log.record("sampler", body.sampling_session_id)
        if session is None:
            raise refuse(404, route, f"unknown sampling session {body.sampling_session_id[:128]!r}")
        # The engine body holds the prompt once per sample: both bounds, or a small body asks for
        # gigabytes (the body cap alone allows a 30M-token prompt).
        if body.num_samples > self.settings.max_samples_per_call:
            raise refuse(
                400,
                route,
                f"num_samples {body.num_samples} is above max_samples_per_call ({self.settings.max_samples_per_call})",
            )
        prompt = sum(len(c.tokens or ()) for c in body.prompt.chunks)
        if prompt > self.settings.max_tokens_per_call:
            raise refuse(
                400,
                route,
                f"a prompt of {prompt} tokens is above max_tokens_per_call ({self.settings.max_tokens_per_call})",
            )
        if len(self.samples) >= self.settings.max_inflight_samples:
            raise refuse(429, route, f"{len(self.samples)} samples running (max_inflight_samples)")
        rid = self.log.new_future("sample", {"sampler": body.sampling_session_id})
        task = asyncio.get_running_loop().create_task(self._sample(rid, body, session))
        self.samples[rid] = task
        task.add_done_callback(lambda _: self.samples.pop(rid, None))
        m.REQUESTS.labels(route, "accepted").inc()
        ids = [f"{rid}:{i}" for i in range(body.num_samples)]
        return wire.UntypedFuture(request_id=rid, sample_sequence_ids=ids)

    async def _sample(self, rid: str, body: wire.SampleRequest, session: dict) -> None:
        started = time.monotonic()
        try:
            result = await self.sampler.sample(body, session)
        except (SampleRefused, wire.Unsupported) as exc:
            self.log.settle(rid, error=str(exc), category="user")
            m.SAMPLES.labels("refused").inc()
        except EngineError as exc:
            self.log.settle(rid, error=str(exc), category="server")
            m.SAMPLES.labels("error").inc()
        except Exception as exc:  # noqa: BLE001  (else the future stays running: a 410 the SDK resends)
            message = f"internal error in sample: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            log_event(log, "tinker sample failed", logging.ERROR, request=rid, error=message)
            self.log.settle(rid, error=message, category="server")
            m.SAMPLES.labels("error").inc()
        else:
            self.log.settle(rid, result={"proto": "sample", **result})
            m.SAMPLES.labels("done").inc()
        m.SAMPLE_SECONDS.observe(time.monotonic() - started)
        self.waiters.notify(rid)

    # --- futures ----------------------------------------------------------------------------------

    async def retrieve(self, rid: str) -> dict | None:
        """The future's record once finished, or None after holding the poll `poll_hold_s`."""
        from starlette.concurrency import run_in_threadpool

        with self.waiters.watch(rid) as finished:
            record = await run_in_threadpool(self.log.future, rid)
            if record is None:
                raise refuse(
                    404, "retrieve_future", f"unknown request_id {rid[:64]!r} (never issued, or expired)"
                )
            if record["state"] not in (DONE, FAILED):
                if record.get("kind") == "sample" and rid not in self.samples:
                    raise refuse(
                        410, "retrieve_future",
                        f"sample {rid} was lost in a restart of the service; the SDK sends it again",
                    )  # fmt: skip
                try:
                    await asyncio.wait_for(finished.wait(), self.settings.poll_hold_s)
                except TimeoutError:
                    pass
                record = await run_in_threadpool(self.log.future, rid)
        return record if record and record["state"] in (DONE, FAILED) else None
