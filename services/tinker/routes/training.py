"""`forward_backward` (protobuf body; `forward` is the same route with `forward_only`) and
`optim_step`: each queues a model command and answers its future."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.deps import ServiceDep, parse
from asyncrl.services.tinker.service import refuse

router = APIRouter(prefix="/api/v1")


@router.post("/forward_backward", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def forward_backward(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    if request.headers.get("content-encoding", "identity") != "identity":
        raise refuse(
            400,
            "forward_backward",
            "compressed bodies are not accepted (this server's client config says so)",
        )
    if wire.PROTOBUF not in request.headers.get("content-type", ""):
        raise refuse(
            400, "forward_backward", f"forward_backward takes a {wire.PROTOBUF} body, as the tinker SDK sends"
        )
    raw = await request.body()
    try:
        call = wire.decode_forward_backward(raw)
    except wire.WireError as exc:
        raise refuse(400, "forward_backward", str(exc)) from None
    return await run_in_threadpool(service.forward_backward, call, raw)


@router.post("/optim_step", response_model=wire.UntypedFuture, response_model_exclude_none=True)
async def optim_step(request: Request, service: ServiceDep) -> wire.UntypedFuture:
    body, raw = await parse(request, wire.OptimStepRequest)
    return await run_in_threadpool(service.optim_step, body, raw)
