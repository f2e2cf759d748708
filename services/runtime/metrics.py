"""Prometheus exposition shared by the services: a `/metrics` route on the default registry.

Naming (docs/architecture.md §9): `asyncrl_` prefix, base units (seconds, bytes), `_total` counters,
bounded label values only (verifier names, stream names, reasons; never ids).
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
