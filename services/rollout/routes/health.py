"""Liveness probe: 503 once a background loop (scheduler, weight follower) has died."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from asyncrl.services.rollout.deps import ServiceDep

router = APIRouter()


class RolloutHealth(BaseModel):
    status: str
    dead_loops: list[str] = []


@router.get("/healthz", response_model=RolloutHealth)
async def healthz(service: ServiceDep):
    dead = service.dead_loops()
    if dead:
        return JSONResponse(RolloutHealth(status="error", dead_loops=dead).model_dump(), status_code=503)
    return RolloutHealth(status="ok")
