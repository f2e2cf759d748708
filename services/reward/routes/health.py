"""`GET /healthz`: liveness plus the state of each verifier (open without auth)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from asyncrl.services.reward.deps import ScorerDep

router = APIRouter()


class RewardHealth(BaseModel):
    status: str
    verifiers: dict[str, str]


@router.get("/healthz", response_model=RewardHealth)
def healthz(scorer: ScorerDep) -> RewardHealth:
    states = {name: verifier.health() for name, verifier in scorer.verifiers.items()}
    return RewardHealth(
        status="ok" if all(s == "ok" for s in states.values()) else "degraded", verifiers=states
    )
