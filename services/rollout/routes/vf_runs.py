"""The gateway's verifiers-run routes (`services/rollout/gateway/vf_runs.py` says what they do);
refusals and counting are the gateway's (`GatewayRoute`: OpenAI's error shape)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from asyncrl.proto.openai import ChatCompletion, GatewayChatRequest
from asyncrl.proto.vf_runs import VfGroupClosed, VfGroupRequest
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.gateway.chat import GatewayError, check_request
from asyncrl.services.rollout.gateway.vf_runs import close_group, ensure_rollout
from asyncrl.services.rollout.routes.gateway import ERRORS, GatewayRoute, _summary, chat_answer

router = APIRouter(tags=["gateway"], route_class=GatewayRoute)
TRACE_HEADER = "x-session-id"  # verifiers' SESSION_ID_HEADER: the rollout's trace id, every call


@router.post(
    "/v1/runs/{run}/v1/chat/completions", name="run_chat", response_model=ChatCompletion, responses=ERRORS
)
async def run_chat_completions(run: str, request: Request, service: ServiceDep):
    """OpenAI's chat completions for a verifiers run (`--client.base-url .../v1/runs/{run}/v1`):
    each rollout (`X-Session-ID`) is one session, recorded, created on its first call."""
    try:
        body = GatewayChatRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise GatewayError(400, _summary(exc), "invalid_body") from None
    check_request(body)
    if body.session_id is not None:
        raise GatewayError(
            400, "a verifiers run names its rollouts by X-Session-ID, not session_id", "session_mismatch"
        )
    sid = await ensure_rollout(service.gateway, run, request.headers.get(TRACE_HEADER))
    return await chat_answer(service, body, sid)


@router.post("/v1/runs/{run}/groups", name="run_group", response_model=VfGroupClosed, responses=ERRORS)
async def run_group(run: str, body: VfGroupRequest, service: ServiceDep) -> VfGroupClosed:
    """Name one group of the run: its rollouts with verifiers' rewards (buffered), or with the
    error one of them ended with (the group fails whole)."""
    return await close_group(service.gateway, run, body)
