"""`GET /healthz`: liveness plus the state of each verifier (open without auth)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from asyncrl.services.reward.deps import ScorerDep

router = APIRouter()


class Health(BaseModel):
    status: str
    verifiers: dict[str, str]


@router.get("/healthz", response_model=Health)
def healthz(scorer: ScorerDep) -> Health:
    states = {name: verifier.health() for name, verifier in scorer.verifiers.items()}
    return Health(status="ok" if all(s == "ok" for s in states.values()) else "degraded", verifiers=states)
