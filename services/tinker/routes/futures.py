"""`retrieve_future`: a finished call's result (JSON, or protobuf for forward_backward and
sample results, which the SDK reads only as protobuf), its failure (`{"error", "category"}`,
which the SDK raises as `RequestFailedError`), or, after holding the poll `poll_hold_s`, 408
with `{"type": "try_again"}`, which the SDK polls again."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.deps import ServiceDep, parse
from asyncrl.services.tinker.worker import arrays_from_json

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(request: Request, service: ServiceDep) -> Response:
    body, _ = await parse(request, wire.FutureRetrieveRequest)
    record = await service.retrieve(body.request_id)
    if record is None:
        return JSONResponse(wire.try_again(body.request_id), status_code=408)
    if record["state"] == "failed":
        return JSONResponse(wire.request_failed(record["error"], record.get("category", "user")))
    result = record["result"]
    kind = result.pop("proto", None)
    if kind == "forward_backward":
        outputs = [arrays_from_json(o) for o in result["outputs"]]
        return Response(
            wire.encode_forward_backward_output(outputs, result["metrics"]), media_type=wire.PROTOBUF
        )
    if kind == "sample":
        sequences = [
            {**s, "logprobs": np.asarray(s["logprobs"], dtype=np.float32)} for s in result["sequences"]
        ]
        return Response(
            wire.encode_sample_response(sequences, result["prompt_logprobs"]), media_type=wire.PROTOBUF
        )
    return JSONResponse(result)
