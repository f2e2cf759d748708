"""Builds the Tinker-compatible service's app from `TinkerServiceSettings`.

One process: this FastAPI app and one training worker thread driving the backend
(`asyncrl.trainer.tinker.TinkerTrainer`, the async trainer's model, losses, checkpoints and
adapter publishing, in process). At start, before the worker runs, the models the command log
holds are rebuilt or given up (`recovery.py`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request

from asyncrl.services.runtime.auth import install_auth
from asyncrl.services.runtime.limits import BodyLimit, install_validation_handler
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.metrics import router as metrics_router
from asyncrl.services.tinker import metrics as m
from asyncrl.services.tinker.commands import CommandLog
from asyncrl.services.tinker.config import TinkerServiceSettings
from asyncrl.services.tinker.paths import public_id
from asyncrl.services.tinker.recovery import recover
from asyncrl.services.tinker.routes import futures, models, sampling, session, training, weights
from asyncrl.services.tinker.service import TinkerService

log = logging.getLogger(__name__)


def build_backend(settings: TinkerServiceSettings) -> tuple[Any, Any]:
    """(the trainer backend, its module: `Datum` and the error classes)."""
    from asyncrl.trainer import tinker as api

    backend = api.TinkerTrainer(
        api.TinkerSettings(
            base_models=dict(settings.base_models),
            weights_root=settings.weights_root,
            checkpoints_root=settings.checkpoints_root,
            max_models=settings.max_models,
            max_lora_rank=settings.max_lora_rank,
            max_tokens_per_call=settings.max_tokens_per_call,
            mixed_precision=settings.mixed_precision,
            threads=settings.threads,
            unembed_without_adapter=settings.unembed_without_adapter,
        )
    )
    return backend, api


def build_app(settings: TinkerServiceSettings, backend: Any = None, api: Any = None) -> FastAPI:
    if backend is None:
        backend, api = build_backend(settings)
    commands = CommandLog(
        redis.Redis.from_url(settings.redis_url, socket_keepalive=True, health_check_interval=30),
        settings.namespace,
        max_queued=settings.max_queued_commands,
        result_ttl_s=settings.result_ttl_s,
    )
    service = TinkerService(settings, commands, backend, api)

    def queued() -> dict[str, int]:
        return {mid: commands.redis.zcard(commands.key("queue", mid)) for mid in commands.live_models()}

    def backend_metrics() -> dict[str, dict[str, float]]:
        return {public_id(bid): figures for bid, figures in backend.metrics().items()}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        outcomes = await asyncio.to_thread(recover, commands, backend)
        service.waiters.loop = asyncio.get_running_loop()
        service.worker.start()
        m.MODELS.add(id(app), backend_metrics, queued)
        log_event(log, "tinker service ready", models=outcomes, engines=len(settings.engine_urls))
        try:
            yield
        finally:
            m.MODELS.remove(id(app))
            service.worker.stop()
            for task in list(service.samples.values()):
                task.cancel()
            await service.sampler.aclose()
            commands.redis.close()

    app = FastAPI(title="asyncrl tinker", version="1", lifespan=lifespan)
    app.state.service = service
    install_auth(app, settings.api_token, api_key_header=True)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, on_refused=m.REQUESTS.labels("any", "limited").inc
    )

    def count_invalid(request: Request, malformed_json: bool) -> None:
        m.REQUESTS.labels(request.url.path.rsplit("/", 1)[-1][:32], "refused").inc()

    install_validation_handler(app, count_invalid, malformed_status=400)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"status": "ok", "models": len(commands.live_models())}

    for module in (session, models, training, weights, sampling, futures):
        app.include_router(module.router)
    app.include_router(metrics_router)
    return app
