"""`POST /v1/rewards` (score a batch) and `GET /v1/verifiers` (what this server can score)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from asyncrl.proto.rewards import RewardRequest, RewardResponse, VerifierInfo, VerifierList
from asyncrl.services.reward.deps import ScorerDep
from asyncrl.services.reward.metrics import REQUESTS
from asyncrl.services.reward.scoring import RequestRejected

router = APIRouter(prefix="/v1")


@router.post(
    "/rewards",
    response_model=RewardResponse,
    responses={
        422: {"description": "malformed body, unknown verifier or invalid spec (whole batch rejected)"}
    },
)
async def score_batch(request: RewardRequest, scorer: ScorerDep) -> Response:
    try:
        jobs = scorer.prepare(request)
    except RequestRejected as exc:
        REQUESTS.labels("rejected").inc()
        raise HTTPException(status_code=422, detail=exc.problems) from None
    REQUESTS.labels("accepted").inc()
    # The results are built from checked verdicts (`Scorer.score`): written out as they are, not
    # validated again field by field, as FastAPI does with a returned model.
    return Response((await scorer.score(jobs)).model_dump_json(), media_type="application/json")


@router.get("/verifiers", response_model=VerifierList)
def list_verifiers(scorer: ScorerDep) -> VerifierList:
    return VerifierList(
        verifiers=[
            VerifierInfo(
                name=name,
                description=v.description,
                spec_schema=v.Spec.model_json_schema(),
                concurrency=v.concurrency,
                timeout_s=v.timeout_s,
            )
            for name, v in sorted(scorer.verifiers.items())
        ]
    )
