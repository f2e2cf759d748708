"""The OpenAI-compatible gateway's routes (`services/rollout/gateway/chat.py` says what they do).

Every refusal is OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}` (the
`openai` client raises it as the matching `APIStatusError`): 400 for a body that does not
validate or asks what the gateway does not do, 404 an unknown or expired session, 409 a closed
session or a group that does not take this session (or was abandoned), 429 a full buffer
(admission), 502 an engine that failed, 503 no engine or no Redis; an unknown path under `/v1/`
(404) and a gateway route asked with the wrong method (405) too (`install_openai_errors`). Each answer is counted by route and status
(`asyncrl_rollout_gateway_requests_total`), each refusal by reason
(`asyncrl_rollout_gateway_errors_total`).

`POST /v1/chat/completions` reads its body itself, so that every refusal has that shape; the
body is OpenAI's (`proto.openai.GatewayChatRequest`) and is not described in `/openapi.json`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import redis
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from asyncrl.proto.gateway import (
    SessionAbandoned,
    SessionClosed,
    SessionCreated,
    SessionRequest,
    SessionReward,
)
from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.proto.openai import ChatCompletion, GatewayChatRequest, ModelList
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.gateway.chat import GatewayError, check_request, sse_chunks

log = logging.getLogger(__name__)

MAX_SUMMARY_ERRORS = 5  # validation errors named in one message
MAX_TEXT_CHARS = 200  # of one error's location or message (they may quote the client)
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


def error_response(
    status: int,
    message: str,
    reason: str,
    retry_after: float | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    text = message.encode("utf-8", "backslashreplace").decode("utf-8")  # (a lone surrogate quoted back)
    body = {
        "error": {
            "message": text,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": reason,
        }
    }
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    return JSONResponse(body, status_code=status, headers=headers or None)


def _summary(exc: ValidationError | RequestValidationError) -> str:
    errors = exc.errors()
    parts = [
        f"{'.'.join(str(p) for p in e.get('loc', ()))[:MAX_TEXT_CHARS]}: {str(e.get('msg', ''))[:MAX_TEXT_CHARS]}"
        for e in errors[:MAX_SUMMARY_ERRORS]
    ]
    more = f" (and {len(errors) - len(parts)} more)" if len(errors) > len(parts) else ""
    return "invalid request body: " + "; ".join(parts) + more


class GatewayRoute(APIRoute):
    """Answers `GatewayError`, a body that does not validate, a Redis failure and a bug in
    OpenAI's error shape, and counts every answer."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        route = self.name

        async def answer(request: Request) -> Response:
            try:
                response = await handler(request)
            except GatewayError as exc:
                response = _refused(route, exc)
            except RequestValidationError as exc:
                response = _refused(route, GatewayError(400, _summary(exc), "invalid_body"))
            except HTTPException as exc:  # FastAPI's own (a body it cannot decode), the body limit's 413
                reason = "invalid_body" if exc.status_code == 400 else f"http_{exc.status_code}"
                response = _refused(route, GatewayError(exc.status_code, str(exc.detail), reason))
            except redis.RedisError as exc:
                response = _refused(
                    route, GatewayError(503, f"the buffer is unavailable: {exc}", "redis", 1.0)
                )
            except Exception as exc:  # a bug: answered (500) and counted like every failure, and logged
                log.exception("gateway %s failed", route)
                response = _refused(
                    route, GatewayError(500, f"internal error: {type(exc).__name__}", "internal")
                )
            m.GATEWAY_REQUESTS.labels(route, str(response.status_code)).inc()
            return response

        return answer


def _refused(route: str, exc: GatewayError) -> JSONResponse:
    m.GATEWAY_ERRORS.labels(route, exc.reason).inc()
    return error_response(exc.status, str(exc), exc.reason, exc.retry_after, exc.param)


router = APIRouter(tags=["gateway"], route_class=GatewayRoute)
ERRORS = {
    code: {"description": kind}
    for code, kind in {
        400: "bad request",
        404: "unknown session",
        409: "conflict",
        429: "buffer full",
        503: "unavailable",
    }.items()
}


@router.post("/v1/sessions", name="sessions", response_model=SessionCreated, responses=ERRORS)
async def create_session(body: SessionRequest, service: ServiceDep) -> SessionCreated:
    """Open a session (in `group_id`'s group, or a new group); its chat calls are recorded."""
    return await service.gateway.open_session(body, service.rewards.verifiers)


@router.post(
    "/v1/sessions/{session_id}/reward", name="reward", response_model=SessionClosed, responses=ERRORS
)
async def close_session(session_id: str, body: SessionReward, service: ServiceDep) -> SessionClosed:
    """Close a session with its reward; closing the group's last session puts the group in the buffer."""
    return await service.gateway.close_session(session_id, body)


@router.delete("/v1/sessions/{session_id}", name="abandon", response_model=SessionAbandoned, responses=ERRORS)
async def abandon_session(session_id: str, service: ServiceDep) -> SessionAbandoned:
    """Abandon a session (its agent crashed, or gave up): its whole group is dropped now, never
    put, and its admission slot given back; the other sessions' later calls and closes answer
    409. Repeated (or for a sibling): 200 with `again: true` while the group's keys last
    (2 × `gateway_session_ttl_s`), 404 after."""
    return await service.gateway.abandon_session(session_id)


@router.get("/v1/models", name="models", response_model=ModelList)
async def list_models(service: ServiceDep) -> ModelList:
    """The served model (the policy), in OpenAI's list shape."""
    return service.gateway.models()


@router.get("/v1/sessions/{session_id}/v1/models", name="session_models", response_model=ModelList)
async def list_session_models(session_id: str, service: ServiceDep) -> ModelList:
    """The same under a session's base URL (clients list models before their first call; the
    session is not created by this)."""
    return service.gateway.models()


SESSION_HEADER = "x-asyncrl-session"  # (not X-Session-Id: verifiers sends its own trace id there)
GROUP_HEADER, GROUP_SIZE_HEADER = "x-asyncrl-group", "x-asyncrl-group-size"


@router.post("/v1/chat/completions", name="chat", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(request: Request, service: ServiceDep):
    """OpenAI's chat completions; the session is `X-AsyncRL-Session` or the body's `session_id`
    (none: answered, not recorded). A foreign `X-Session-Id` is ignored."""
    return await _chat(request, service, None)


@router.post(
    "/v1/sessions/{session_id}/v1/chat/completions",
    name="session_chat",
    response_model=ChatCompletion,
    responses=ERRORS,
)
async def session_chat_completions(session_id: str, request: Request, service: ServiceDep):
    """The same, the session in the URL (`base_url=.../v1/sessions/{id}/v1`); an unknown session
    is created on first use, in the group `X-AsyncRL-Group` (default: the session's own) of
    `X-AsyncRL-Group-Size` (default 1)."""
    return await _chat(request, service, session_id)


def _group_size(request: Request) -> int:
    raw = request.headers.get(GROUP_SIZE_HEADER, "1")
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise GatewayError(
            400,
            f"X-AsyncRL-Group-Size must be an integer in 1..{MAX_GROUP_SIZE}, not {raw[:32]!r}",
            "group_size",
        )
    return size


async def _chat(request: Request, service: ServiceDep, url_session: str | None):
    try:
        body = GatewayChatRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise GatewayError(400, _summary(exc), "invalid_body") from None
    check_request(body)
    session = await open_named_session(request, service, url_session, body.session_id)
    return await chat_answer(service, body, session)


async def open_named_session(
    request: Request, service: ServiceDep, url_session: str | None, body_session: str | None
) -> str | None:
    """The call's session: the URL's, `X-AsyncRL-Session` or the body's `session_id` (at most
    one name; none: answered, not recorded). A session named in the URL is created on first use."""
    named = {n for n in (url_session, request.headers.get(SESSION_HEADER), body_session) if n is not None}
    if len(named) > 1:
        raise GatewayError(
            400, "the URL, X-AsyncRL-Session and session_id name different sessions", "session_mismatch"
        )
    if url_session is not None:
        group = request.headers.get(GROUP_HEADER)
        await service.gateway.ensure_session(url_session, group, _group_size(request))
    return next(iter(named), None)


async def chat_answer(service: ServiceDep, body: GatewayChatRequest, session: str | None):
    """The chat call answered in `session`: the completion, or its SSE chunks when streamed."""
    answer, _ = await service.gateway.complete(body, session)
    if not body.stream:
        return answer
    return event_stream(sse_chunks(answer, bool(body.stream_options and body.stream_options.include_usage)))


def event_stream(events: list[str]) -> StreamingResponse:
    """Server-sent events already rendered, as one streamed answer."""

    async def send() -> AsyncIterator[str]:
        for event in events:
            yield event

    return StreamingResponse(send(), media_type="text/event-stream")


def install_openai_errors(app) -> None:
    """Answer an unknown path under `/v1/` (404) and a gateway route asked with the wrong
    method (405) in OpenAI's error shape, counted (route `unmatched`); every other HTTP error
    keeps FastAPI's shape (the rollouts and evaluations routes', and their own 404s)."""
    from fastapi.exception_handlers import http_exception_handler

    async def handle(request: Request, exc: HTTPException) -> Response:
        route = request.scope.get("route")
        unmatched = exc.status_code == 404 and "endpoint" not in request.scope
        wrong_method = exc.status_code == 405 and isinstance(route, GatewayRoute)
        if not request.url.path.startswith("/v1/") or not (unmatched or wrong_method):
            return await http_exception_handler(request, exc)
        if unmatched:
            message, reason = f"no route {request.url.path[:MAX_TEXT_CHARS]!r}", "unknown_route"
        else:
            allowed = (exc.headers or {}).get("allow", (exc.headers or {}).get("Allow", ""))
            message = f"{request.method} is not allowed on {request.url.path[:MAX_TEXT_CHARS]!r} (allowed: {allowed})"
            reason = "method_not_allowed"
        m.GATEWAY_ERRORS.labels("unmatched", reason).inc()
        m.GATEWAY_REQUESTS.labels("unmatched", str(exc.status_code)).inc()
        return error_response(exc.status_code, message, reason, headers=exc.headers)

    app.add_exception_handler(HTTPException, handle)
