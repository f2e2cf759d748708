"""`create_model` (a future) and `get_info`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.deps import ServiceDep, parse

router = APIRouter(prefix="/api/v1")


@router.post("/create_model", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def create_model(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, raw = await parse(request, wire.CreateModelRequest)
    return await run_in_threadpool(service.create_model, body, raw)


@router.post("/get_info", response_model=wire.GetInfoResponse)
async def get_info(request: Request, service: ServiceDep) -> wire.GetInfoResponse:
    body, _ = await parse(request, wire.GetInfoRequest)
    return await run_in_threadpool(service.info, body.model_id)
