"""FastAPI app of the rollout service: `/v1/rollouts`, `/v1/evaluations`, `/healthz`, `/metrics`.

Body errors answer 400 (malformed JSON) or 422 (wrong types, out-of-range values) with a
one-line `message` naming the fields, plus FastAPI's `detail` list; every refusal is counted
in `asyncrl_rollout_requests_rejected_total`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.common.auth import install_auth
from services.common.metrics import router as metrics_router
from services.rollout import metrics as m
from services.rollout.routes import evaluations, health, rollouts
from services.rollout.service import RolloutService


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
    install_auth(app)
    app.include_router(metrics_router)
    app.include_router(health.router)
    app.include_router(rollouts.router)
    app.include_router(evaluations.router)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        malformed = any(e.get("type") == "json_invalid" for e in errors)
        m.REQUESTS_REJECTED.labels("malformed_json" if malformed else "invalid_body").inc()
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:5])
        return JSONResponse(
            {"message": message or "invalid request body", "detail": errors},
            status_code=400 if malformed else 422,
        )

    return app
