"""Refusals shared by the rollout service's routes: one `ErrorBody` shape, every one counted."""

from __future__ import annotations

from fastapi import HTTPException

from asyncrl.proto.rollout import ErrorBody
from asyncrl.services.rollout import metrics as m

ERRORS = {
    400: {"model": ErrorBody},
    404: {"model": ErrorBody},
    409: {"model": ErrorBody},
    422: {"model": ErrorBody},
    503: {"model": ErrorBody},
}


def refuse(status: int, message: str, reason: str) -> HTTPException:
    """The exception to raise for a refused request, counted in
    `asyncrl_rollout_requests_rejected_total{reason}`."""
    m.REQUESTS_REJECTED.labels(reason).inc()
    return HTTPException(status_code=status, detail=message)
