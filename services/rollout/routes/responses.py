"""The gateway's Responses API routes (`services/rollout/gateway/responses.py` says what they
do); refusals and counts as every gateway route (`GatewayRoute`, routes/gateway.py). The body
is read by the route itself, so that every refusal has OpenAI's error shape."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from asyncrl.proto.openai_responses import ResponseObject, ResponsesRequest
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.gateway.chat import GatewayError
from asyncrl.services.rollout.gateway.responses import Responses, check_responses_request, stream_events
from asyncrl.services.rollout.routes.gateway import (
    ERRORS,
    MAX_SUMMARY_ERRORS,
    MAX_TEXT_CHARS,
    GatewayRoute,
    event_stream,
    open_named_session,
)

router = APIRouter(tags=["gateway"], route_class=GatewayRoute)
RESPONSES_ERRORS = {**ERRORS, 404: {"description": "unknown session or previous response"}}


@router.post("/v1/responses", name="responses", response_model=ResponseObject, responses=RESPONSES_ERRORS)
async def create_response(request: Request, service: ServiceDep):
    """OpenAI's Responses API; the session is `X-AsyncRL-Session` or the body's `session_id`
    (none: answered, not recorded)."""
    return await _respond(request, service, None)


@router.post(
    "/v1/sessions/{session_id}/v1/responses",
    name="session_responses",
    response_model=ResponseObject,
    responses=RESPONSES_ERRORS,
)
async def create_session_response(session_id: str, request: Request, service: ServiceDep):
    """The same, the session in the URL, created on first use as for chat (`X-AsyncRL-Group`,
    `X-AsyncRL-Group-Size`)."""
    return await _respond(request, service, session_id)


async def _respond(request: Request, service: ServiceDep, url_session: str | None):
    try:
        body = ResponsesRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise GatewayError(400, summary(exc), "invalid_body") from None
    check_responses_request(body)
    session = await open_named_session(request, service, url_session, body.session_id)
    response = await Responses(service.gateway).create(body, session)
    if not body.stream:
        return response
    return event_stream(stream_events(response))


# Location parts that name a union's member, not a field: the tags of `InputItem`, the types.
_MEMBER_TAGS = frozenset({"str", "message", "function_call", "function_call_output"})


def summary(exc: ValidationError) -> str:
    """The body's errors at the fields the client wrote (`input.0.content.0.type`), without
    pydantic's union members, and without the "not a string" of `input` when it is a list."""
    found: list[tuple[tuple, str]] = []
    for error in exc.errors():
        loc = tuple(
            p
            for p in error.get("loc", ())
            if not (isinstance(p, str) and (p in _MEMBER_TAGS or "[" in p or p[:1].isupper()))
        )
        if (loc, error["msg"]) not in found:
            found.append((loc, str(error["msg"])))
    kept = [
        (loc, msg)
        for loc, msg in found
        if not (
            msg == "Input should be a valid string"
            and any(o[: len(loc)] == loc and len(o) > len(loc) for o, _ in found)
        )
    ]
    parts = [
        f"{'.'.join(str(p) for p in loc)[:MAX_TEXT_CHARS]}: {msg[:MAX_TEXT_CHARS]}"
        for loc, msg in kept[:MAX_SUMMARY_ERRORS]
    ]
    more = f" (and {len(kept) - len(parts)} more)" if len(kept) > len(parts) else ""
    return "invalid request body: " + "; ".join(parts) + more
