"""Bearer-token auth (DESIGN.md §9): when `ASYNCRL_API_TOKEN` is set, every endpoint except
the health and metrics probes requires `Authorization: Bearer <token>`."""

from __future__ import annotations

import hmac
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

OPEN_PATHS = frozenset({"/healthz", "/health", "/metrics"})


def install_auth(app: FastAPI, token: str | None = None) -> None:
    token = token if token is not None else os.environ.get("ASYNCRL_API_TOKEN") or None
    if not token:
        return
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def _require_bearer(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return JSONResponse({"detail": "missing or invalid bearer token"}, status_code=401)
        return await call_next(request)
