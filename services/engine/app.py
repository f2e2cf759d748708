"""FastAPI app of the reference engine: SGLang's native HTTP API (the subset of docs/architecture.md §7)
plus an OpenAI-compatible, non-streaming `/v1/chat/completions`.

Status codes follow SGLang's http_server: 200 on success; 400 with `{"error": {"message"}}`
for a refused request or a failed control operation (`success: false` bodies for the weight
and LoRA endpoints; `/unload_lora_adapter` answers once the adapter's requests in flight have
ended); 413 for a body over `max_body_bytes`; 422 for a body that does not match the
schema (bounded, `services/runtime/limits.py`); 503 when the queue is full or a weight update
found no turn in time; 409 for a second `/init_weights_update_group` while one is joining, and
for a broadcast delta bucket the engine will not take (not on its base, a sha256 that differs:
the sender sends the full version).

Auth (`services/runtime/auth.py`), `Authorization: Bearer <token>`, 401 when wrong or missing:
every endpoint outside DATA_PATHS and the probes, i.e. every control endpoint (weight
updates, update groups, LoRA loads and unloads, pause/continue, abort, flush) and any added
later, needs the engine token, and answers 403 on an engine started without one (loopback
only, see config.py). The
DATA_PATHS take the engine token or `ASYNCRL_API_TOKEN`, and are open when that is unset and
the engine listens on loopback. `/health` and `/metrics` are open; `/health` is 200, or 503
with `{"status": "degraded", "reason", "message"}` while weight sync is failing (the rule:
`services/engine/updates.py`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from asyncrl.proto.openai import ChatCompletion, ChatRequest
from asyncrl.proto.sglang import (
    AbortReq,
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ModelInfo,
    PauseGenerationReqInput,
    ReferenceUpdateWeightsFromDistributedReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    WeightUpdateOutput,
    check_unicode,
)
from asyncrl.services.engine import metrics
from asyncrl.services.engine.adapters import LoraResult
from asyncrl.services.engine.config import is_loopback
from asyncrl.services.engine.engine import InferenceEngine, InvalidRequest
from asyncrl.services.runtime.auth import API_TOKEN_ENV, install_engine_auth
from asyncrl.services.runtime.limits import BodyLimit, install_validation_handler
from asyncrl.services.runtime.metrics import router as metrics_router

_JSON = msgspec.json.Encoder()

# The data plane: generation and read-only info (everything else is control).
DATA_PATHS = frozenset(
    {
        "/generate",
        "/v1/chat/completions",
        "/v1/models",
        "/model_info",
        "/server_info",
        "/get_model_info",
        "/get_server_info",
        "/get_weight_version",
        "/health_generate",
    }
)
FINISH_TO_OPENAI = {"stop": "stop", "length": "length", "abort": "abort"}
# OpenAI request fields that do not change what is generated.
HARMLESS_CHAT_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
)


def build_app(engine: InferenceEngine, *, tokenless_control: bool = False) -> FastAPI:
    """`tokenless_control`: without a token, leave the control endpoints open too. Only for
    in-process test engines on loopback (`tests/engine_server.py`); `asyncrl engine` never
    sets it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="asyncrl reference engine (SGLang native API)", lifespan=lifespan)
    app.state.engine = engine
    token, api_token = engine.settings.token, os.environ.get(API_TOKEN_ENV) or None
    guard_data = api_token is not None or not is_loopback(engine.settings.host)
    install_engine_auth(
        app,
        control_token=token,
        data_tokens=[t for t in {api_token, token} if t] if guard_data else [],
        data_paths=DATA_PATHS,
        control_open=tokenless_control,
    )
    app.add_middleware(
        BodyLimit,
        max_bytes=engine.settings.max_body_bytes,
        on_refused=metrics.REQUESTS_REJECTED.labels(reason="body_too_large").inc,
    )
    app.include_router(metrics_router)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        metrics.REQUESTS_REJECTED.labels(reason=exc.reason).inc()
        return JSONResponse({"error": {"message": str(exc), "code": exc.status}}, status_code=exc.status)

    def count_malformed(request: Request, malformed_json: bool) -> None:
        metrics.REQUESTS_REJECTED.labels(reason="malformed").inc()

    install_validation_handler(app, count_malformed, sglang_error=True)

    # --- generation -----------------------------------------------------------------------

    @app.post("/generate")
    async def generate(body: GenerateReqInput) -> Response:
        # Already plain JSON types: skip FastAPI's element-by-element encoder (slow on logprob
        # lists) and encode with msgspec (several times faster than the json module).
        return Response(_JSON.encode(await engine.generate(body)), media_type="application/json")

    # (exclude_unset: an answer carries the fields the engine sets, no `tool_calls: null`)
    @app.post("/v1/chat/completions", response_model=ChatCompletion, response_model_exclude_unset=True)
    async def chat_completions(body: ChatRequest) -> ChatCompletion:
        return await _chat(engine, body)

    @app.get("/v1/models")
    async def list_models() -> dict:
        name = engine.settings.served_model_name or engine.settings.model
        base = {"id": name, "object": "model", "owned_by": "asyncrl"}
        # one card per loaded adapter, its path as loaded and the base model as parent (SGLang 0.5.23)
        adapters = engine.adapters.loaded_paths() if engine.adapters is not None else {}
        cards = [
            {"id": n, "object": "model", "owned_by": "asyncrl", "root": p, "parent": name}
            for n, p in adapters.items()
        ]
        return {"object": "list", "data": [base, *cards]}

    @app.post("/abort_request")
    async def abort_request(body: AbortReq) -> Response:
        engine.scheduler.abort(body.rid, body.abort_all, body.abort_message)
        return Response(status_code=200)

    # --- weights --------------------------------------------------------------------------

    @app.post("/update_weights_from_disk", response_model=UpdateWeightFromDiskReqOutput)
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput) -> JSONResponse:
        r = await engine.update_weights_from_disk(body)
        out = UpdateWeightFromDiskReqOutput(
            success=r.ok, message=r.message, num_paused_requests=r.num_paused_requests
        )
        return JSONResponse(out.model_dump(), status_code=r.status)

    @app.post("/init_weights_update_group", response_model=WeightUpdateOutput)
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        r = await engine.init_weights_update_group(body)
        return JSONResponse({"success": r.ok, "message": r.message}, status_code=r.status)

    @app.post("/update_weights_from_distributed", response_model=WeightUpdateOutput)
    async def update_weights_from_distributed(
        body: ReferenceUpdateWeightsFromDistributedReqInput,
    ) -> JSONResponse:
        r = await engine.update_weights_from_distributed(body)
        return JSONResponse({"success": r.ok, "message": r.message}, status_code=r.status)

    @app.post("/begin_weight_update", response_model=WeightUpdateOutput)
    async def begin_weight_update(body: BeginWeightUpdateReqInput | None = None) -> JSONResponse:
        # `selector` names SGLang's target and draft runners; this engine has one model
        r = engine.begin_weight_update()
        return JSONResponse({"success": r.ok, "message": r.message}, status_code=r.status)

    @app.post("/end_weight_update", response_model=WeightUpdateOutput)
    async def end_weight_update(body: EndWeightUpdateReqInput | None = None) -> JSONResponse:
        r = engine.end_weight_update()
        return JSONResponse({"success": r.ok, "message": r.message}, status_code=r.status)

    # --- LoRA adapters --------------------------------------------------------------------

    @app.post("/load_lora_adapter", response_model=LoRAUpdateOutput)
    async def load_lora_adapter(body: LoadLoRAAdapterReqInput) -> JSONResponse:
        return _lora_answer(await engine.load_lora_adapter(body))

    @app.post("/unload_lora_adapter", response_model=LoRAUpdateOutput)
    async def unload_lora_adapter(body: UnloadLoRAAdapterReqInput) -> JSONResponse:
        return _lora_answer(await engine.unload_lora_adapter(body))

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    # --- scheduling control ---------------------------------------------------------------

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqInput | None = None) -> dict:
        mode = (body or PauseGenerationReqInput()).mode
        affected = await engine.on_scheduler(lambda: engine.scheduler.pause(mode))
        return {
            "message": "Generation paused successfully.",
            "status": "ok",
            "mode": mode,
            "num_requests": affected,
        }

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationReqInput | None = None) -> dict:
        # `torch_empty_cache` (0.5.23's body) asks SGLang to return cached CUDA blocks before
        # resuming; this engine keeps no allocator cache to return, so there is nothing to do.
        await engine.on_scheduler(engine.scheduler.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # No prefix cache is kept across requests, so flushing has nothing to drop; like SGLang
        # it refuses while requests are in flight.
        idle = await engine.on_scheduler(
            lambda: not engine.scheduler.running and not engine.scheduler.waiting
        )
        if idle:
            return PlainTextResponse("Cache flushed.\n", status_code=200)
        return PlainTextResponse("Cache not flushed: requests are in flight.\n", status_code=400)

    # --- probes and info ------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        degraded = engine.updates.degraded()
        if degraded is None:
            return Response(status_code=200)
        return JSONResponse({"status": "degraded", **degraded}, status_code=503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await engine.health_generate() else 503)

    @app.get("/model_info", response_model=ModelInfo)
    @app.get("/get_model_info", response_model=ModelInfo)  # deprecated name, as in SGLang 0.5.23
    async def model_info() -> ModelInfo:
        config = engine.runner.config
        return ModelInfo(
            model_path=engine.settings.model,
            tokenizer_path=engine.settings.model,
            weight_version=engine.weight_version,
            model_type=getattr(config, "model_type", None),
            architectures=getattr(config, "architectures", None),
        )

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated name, as in SGLang 0.5.23
    async def server_info() -> dict:
        return engine.server_info()

    return app


def _lora_answer(r: LoraResult) -> JSONResponse:
    out = LoRAUpdateOutput(success=r.ok, error_message=r.error_message, loaded_adapters=r.loaded_adapters)
    return JSONResponse(out.model_dump(), status_code=r.status)


def check_text_messages(body: ChatRequest) -> None:
    """The reference engine renders text messages only: content a string (not parts, not
    missing), role, content and model valid Unicode. Refused as an invalid body (422)."""
    errors = []
    for i, message in enumerate(body.messages):
        if not isinstance(message.content, str):
            errors.append(
                _invalid(("messages", i, "content"), "string_type", "Input should be a valid string")
            )
    texts = [(("model",), body.model)] + [
        ((("messages", i, name)), getattr(m, name))
        for i, m in enumerate(body.messages)
        for name in ("role", "content")
    ]
    for loc, text in texts:
        try:
            check_unicode(text)
        except ValueError as exc:
            errors.append(_invalid(loc, "value_error", f"Value error, {exc}"))
    if errors:
        raise RequestValidationError(errors)


def _invalid(loc: tuple, kind: str, message: str) -> dict:
    return {"loc": ("body", *loc), "type": kind, "msg": message}


async def _chat(engine: InferenceEngine, body: ChatRequest) -> ChatCompletion:
    check_text_messages(body)
    if body.stream:
        raise InvalidRequest("stream=true is not supported by the reference engine")
    changes_output = {
        k: v for k, v in (body.model_extra or {}).items() if v not in (None, 0, 0.0, [], {}, False)
    }
    changes_output = {k: v for k, v in changes_output.items() if k not in HARMLESS_CHAT_FIELDS}
    if changes_output:
        raise InvalidRequest(f"not supported by the reference engine: {sorted(changes_output)}")
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model's tokenizer has no chat template")
    messages = [m.model_dump(exclude_unset=True) for m in body.messages]  # as given, nothing added
    engine.check_text_length(sum(len(m.content) for m in body.messages))

    def render() -> list[int]:  # in a thread, like /generate's tokenization: /health stays fast
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]

    ids = await asyncio.to_thread(render)
    room = engine.runner.context_length - len(ids)
    if room <= 0:
        raise InvalidRequest(
            f"the rendered prompt has {len(ids)} tokens: no room left in the context length "
            f"{engine.runner.context_length}"
        )
    max_tokens = (
        body.max_completion_tokens or body.max_tokens or min(room, engine.settings.max_new_tokens_cap)
    )
    params = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p}
    if body.seed is not None:
        params["sampling_seed"] = body.seed
    out = await engine.generate(
        GenerateReqInput(
            input_ids=ids, sampling_params=params, return_logprob=body.logprobs, return_text_in_logprobs=True
        )
    )
    meta = out["meta_info"]
    logprobs = None
    if body.logprobs:
        logprobs = {
            "content": [
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                for lp, _, text in meta["output_token_logprobs"]
            ]
        }
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        object="chat.completion",
        created=int(time.time()),
        model=body.model or engine.settings.served_model_name or engine.settings.model,
        choices=[
            {
                "index": 0,
                "message": {"role": "assistant", "content": out["text"]},
                "finish_reason": FINISH_TO_OPENAI[meta["finish_reason"]["type"]],
                "logprobs": logprobs,
            }
        ],
        usage={
            "prompt_tokens": meta["prompt_tokens"],
            "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
        },
    )
