"""`save_weights`, `save_weights_for_sampler` and `load_weights`: model commands (futures)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.deps import ServiceDep, parse

router = APIRouter(prefix="/api/v1")


@router.post("/save_weights", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def save_weights(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, raw = await parse(request, wire.SaveWeightsRequest)
    return await run_in_threadpool(service.save_weights, body, raw)


@router.post("/save_weights_for_sampler", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def save_weights_for_sampler(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, raw = await parse(request, wire.SaveWeightsForSamplerRequest)
    return await run_in_threadpool(service.save_weights_for_sampler, body, raw)


@router.post("/load_weights", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def load_weights(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, raw = await parse(request, wire.LoadWeightsRequest)
    return await run_in_threadpool(service.load_weights, body, raw)
