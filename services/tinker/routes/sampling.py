"""Sampling sessions (an immutable version: a base model or one sampler checkpoint) and
`asample` (a future, run on the engines)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.deps import ServiceDep, parse
from asyncrl.services.tinker.service import refuse

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session", response_model=wire.CreateSamplingSessionResponse)
async def create_sampling_session(
    request: Request, service: ServiceDep
) -> wire.CreateSamplingSessionResponse:
    body, _ = await parse(request, wire.CreateSamplingSessionRequest)
    sid = await run_in_threadpool(service.create_sampling_session, body)
    return wire.CreateSamplingSessionResponse(sampling_session_id=sid)


@router.get("/samplers/{sampler_id}", response_model=wire.SamplerInfo)
async def sampler(sampler_id: str, service: ServiceDep) -> wire.SamplerInfo:
    return await run_in_threadpool(service.sampler_info, sampler_id)


@router.post("/asample", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def asample(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, _ = await parse(request, wire.SampleRequest)
    try:
        body.prompt.tokens()
    except wire.Unsupported as exc:
        raise refuse(400, "asample", str(exc)) from None
    return service.start_sample(body)
