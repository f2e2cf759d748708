"""FastAPI app of the rollout service: `/v1/rollouts`, `/v1/evaluations`, the engine fleet
(`/v1/engines`), the OpenAI-compatible gateway (`/v1/sessions`, `/v1/chat/completions`, verifiers
runs `/v1/runs/{run}/…`), `/healthz`, `/metrics`.

Body errors answer 400 (malformed JSON) or 422 (wrong types, out-of-range values) with a
one-line `message` naming the fields, plus a bounded `detail` list (`services/runtime/limits.py`);
a body over `max_body_bytes` answers 413 unread. Every refusal is counted in
`asyncrl_rollout_requests_rejected_total`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.routes import (
    engines,
    evaluations,
    gateway,
    health,
    responses,
    rollouts,
    vf_runs,
)
from asyncrl.services.rollout.service import RolloutService
from asyncrl.services.runtime.auth import install_auth
from asyncrl.services.runtime.limits import BodyLimit, InflightLimit, install_validation_handler
from asyncrl.services.runtime.metrics import router as metrics_router


def build_app(service: RolloutService, *, run_scheduler: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start(run_scheduler=run_scheduler)
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="asyncrl rollout service", lifespan=lifespan)
    app.state.service = service
    install_auth(app, engine_control=(engines.router.prefix,))  # it sends the engine token
    app.add_middleware(
        BodyLimit,
        max_bytes=service.settings.max_body_bytes,
        on_refused=m.REQUESTS_REJECTED.labels("body_too_large").inc,
    )
    app.add_middleware(
        InflightLimit,
        max_inflight=service.settings.max_inflight_submissions,
        on_refused=m.REQUESTS_REJECTED.labels("overloaded").inc,
        prefixes=("/v1/rollouts", "/v1/evaluations"),
    )
    # Gateway calls last as long as a generation: they get their own, larger, bound.
    app.add_middleware(
        InflightLimit,
        max_inflight=service.settings.gateway_max_inflight,
        on_refused=m.GATEWAY_ERRORS.labels("any", "overloaded").inc,
        prefixes=("/v1/sessions", "/v1/chat/", "/v1/responses", "/v1/runs/"),
    )
    app.include_router(metrics_router)
    app.include_router(health.router)
    app.include_router(rollouts.router)
    app.include_router(evaluations.router)
    app.include_router(engines.router)
    app.include_router(gateway.router)
    app.include_router(vf_runs.router)  # verifiers runs through the gateway
    app.include_router(responses.router)

    def count_invalid(request: Request, malformed_json: bool) -> None:
        m.REQUESTS_REJECTED.labels("malformed_json" if malformed_json else "invalid_body").inc()

    install_validation_handler(app, count_invalid, malformed_status=400)
    gateway.install_openai_errors(app)  # (after: its 404/405 under /v1/ answer OpenAI's shape)
    return app
