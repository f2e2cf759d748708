"""`GET /v1/environments`, `POST /v1/environments/{name}/reset` and `…/{name}/step` (the
bodies in `proto/environments.py`). Every step is counted by environment and status, every masked or
crashed step by failure kind, every refusal by reason (`services/reward/metrics.py`)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError

from asyncrl.proto.environments import (
    EnvironmentList,
    ResetBatch,
    ResetRequest,
    ResetResponse,
    ResetResults,
    StepBatch,
    StepRequest,
    StepResponse,
    StepResults,
    StepStatus,
)
from asyncrl.proto.verifiers import SpecError
from asyncrl.services.reward.deps import EnvironmentDep, EnvironmentsDep
from asyncrl.services.reward.metrics import ENV_FAILURES, ENV_RESETS, ENV_STEP_LATENCY, ENV_STEPS

router = APIRouter(prefix="/v1/environments")
REFUSALS = {
    404: {"description": "unknown or disabled environment"},
    422: {"description": "malformed body, or task arguments (`args`) the environment refuses"},
}


def _invalid_args(exc: SpecError) -> RequestValidationError:
    """Task arguments the environment refuses, answered (and counted, `invalid_body`) by the
    service's validation handler: the same 422 body as any other field of the request."""
    errors = [
        {"loc": ("body", "args", field), "msg": msg, "type": "value_error"} for field, msg in exc.problems
    ]
    return RequestValidationError(errors)


@router.get("", response_model=EnvironmentList)
def list_environments(environments: EnvironmentsDep) -> EnvironmentList:
    return EnvironmentList(environments={name: env.info() for name, env in sorted(environments.items())})


@router.post("/{name}/reset", response_model=ResetResponse, responses=REFUSALS)
async def reset(request: ResetRequest, env: EnvironmentDep) -> ResetResponse:
    try:
        response = await env.reset(request)
    except SpecError as exc:
        raise _invalid_args(exc) from None
    ENV_RESETS.labels(env.name).inc()
    return response


@router.post("/{name}/step", response_model=StepResponse, responses=REFUSALS)
async def step(request: StepRequest, env: EnvironmentDep) -> StepResponse:
    started = time.monotonic()
    try:
        response = await env.step(request)
    except SpecError as exc:
        raise _invalid_args(exc) from None
    except Exception:  # counted, then answered 500 as FastAPI does (the client retries)
        ENV_FAILURES.labels(env.name, "crash").inc()
        raise
    ENV_STEP_LATENCY.labels(env.name).observe(time.monotonic() - started)
    ENV_STEPS.labels(env.name, response.status.value).inc()
    if response.mask_sample:
        ENV_FAILURES.labels(env.name, response.failure_kind or "unknown").inc()
    return response


@router.post("/{name}/reset_batch", response_model=ResetResults, responses=REFUSALS)
async def reset_batch(batch: ResetBatch, env: EnvironmentDep) -> ResetResults:
    try:
        results = await asyncio.gather(*(env.reset(item) for item in batch.items))
    except SpecError as exc:
        raise _invalid_args(exc) from None
    ENV_RESETS.labels(env.name).inc(len(results))
    return ResetResults(results=results)


@router.post("/{name}/step_batch", response_model=StepResults, responses=REFUSALS)
async def step_batch(batch: StepBatch, env: EnvironmentDep) -> StepResults:
    """The items' steps, concurrently; task arguments are refused for the whole batch (422), a
    step that crashes masks its own episode (counted `crash`)."""
    started = time.monotonic()

    async def one(item: StepRequest) -> StepResponse:
        try:
            return await env.step(item)
        except SpecError:
            raise
        except Exception as exc:  # noqa: BLE001 — this episode's failure, answered in-band
            return StepResponse(
                status=StepStatus.tool_error,
                done=True,
                mask_sample=True,
                failure_kind="crash",
                observation=f"environment error: {type(exc).__name__}",
            )

    try:
        results = await asyncio.gather(*(one(item) for item in batch.items))
    except SpecError as exc:
        raise _invalid_args(exc) from None
    ENV_STEP_LATENCY.labels(env.name).observe(time.monotonic() - started)
    for response in results:
        ENV_STEPS.labels(env.name, response.status.value).inc()
        if response.mask_sample:
            ENV_FAILURES.labels(env.name, response.failure_kind or "unknown").inc()
    return StepResults(results=results)
