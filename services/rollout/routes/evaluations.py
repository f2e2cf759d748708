"""`/v1/evaluations`: submit an evaluation (202), read one with its items, list a run's.

A submitted evaluation is queued in Redis; whichever replica claims it first runs it (see
`services/rollout/evaluations/evaluator.py`). Nothing here touches the replay buffer or admission.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from asyncrl.proto.evals import (
    EVAL_NAME_PATTERN,
    EvalAccepted,
    EvalList,
    EvalRequest,
    EvalResult,
    EvalSummary,
)
from asyncrl.proto.sglang import SamplingParams
from asyncrl.proto.states import JobState
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.rewards import VerifiersUnavailable
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.evaluations.evaluator import (
    body_hash,
    build_task,
    eval_id_for,
    new_summary,
    sampling_params,
)
from asyncrl.services.rollout.intake import BadRequest, check_engine_support, check_reward_specs
from asyncrl.services.rollout.routes.errors import ERRORS, refuse

router = APIRouter(prefix="/v1/evaluations", tags=["evaluations"])


@router.post("", status_code=202, response_model=EvalAccepted, responses=ERRORS)
async def submit(body: EvalRequest, service: ServiceDep) -> EvalAccepted:
    store, settings = service.evals, service.settings
    eval_id = eval_id_for(settings.run, body.idempotency_key)
    digest = body_hash(body)
    if body.idempotency_key is not None and (known := await run_in_threadpool(store.summary, eval_id)):
        return _duplicate(known, digest, body)
    try:
        verifiers = await service.rewards.verifiers()
    except VerifiersUnavailable as exc:
        raise refuse(503, str(exc), "reward_unavailable") from exc
    engine_kind = await service.engine_kind()
    try:
        check_engine_support(body.sampling_params or SamplingParams(), engine_kind)
        await run_in_threadpool(check_reward_specs, body.prompts, body.reward_spec, verifiers)
        params = sampling_params(settings, body.sampling_params)
        task = await run_in_threadpool(
            build_task, service.intake, body.prompts, body.reward_spec, params, body.name, verifiers
        )
    except BadRequest as exc:
        raise refuse(exc.status, str(exc), exc.reason) from exc
    summary = new_summary(eval_id, body.name, "api", task, digest)
    if not await run_in_threadpool(store.create, summary, task):  # the same key, submitted concurrently
        return _duplicate(await run_in_threadpool(store.summary, eval_id), digest, body)
    m.EVALS_SUBMITTED.labels("api").inc()
    return EvalAccepted(eval_id=eval_id, name=body.name, state=JobState.queued)


def _duplicate(known: EvalSummary | None, digest: str, body: EvalRequest) -> EvalAccepted:
    if known is None or known.body_hash != digest:
        raise refuse(
            409, f"idempotency key {body.idempotency_key!r} was used for a different evaluation", "conflict"
        )
    return EvalAccepted(eval_id=known.eval_id, name=known.name, state=known.state, duplicate=True)


@router.get("", response_model=EvalList, responses=ERRORS)
async def listing(
    service: ServiceDep, name: Annotated[str | None, Query(pattern=EVAL_NAME_PATTERN)] = None
) -> EvalList:
    """Summaries (no items) ordered by version, optionally of one evaluation name."""
    return EvalList(evaluations=await run_in_threadpool(service.evals.list, name))


@router.get("/{eval_id}", response_model=EvalResult, responses=ERRORS)
async def get(eval_id: str, service: ServiceDep) -> EvalResult:
    def read() -> EvalResult:
        found = service.evals.get(eval_id)
        if found is None:
            raise refuse(404, f"no evaluation {eval_id[:80]!r}", "unknown_eval")
        return EvalResult(**found[0].model_dump(), items=found[1])

    return await run_in_threadpool(read)
