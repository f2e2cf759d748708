"""Sessions and what the SDK asks before its first call: client config, capabilities,
heartbeats, telemetry (counted and dropped), a session's end (its models are released)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker import metrics as m
from asyncrl.services.tinker.deps import ServiceDep, parse
from asyncrl.services.tinker.service import refuse

router = APIRouter(prefix="/api/v1")


@router.get("/healthz", response_model=wire.HealthResponse)
def api_health() -> wire.HealthResponse:
    return wire.HealthResponse()


@router.post("/client/config", response_model=wire.ClientConfigResponse)
def client_config() -> wire.ClientConfigResponse:
    return wire.ClientConfigResponse()


@router.post("/client/dynamic_config", response_model=wire.ClientDynamicConfigResponse)
def client_dynamic_config() -> wire.ClientDynamicConfigResponse:
    return wire.ClientDynamicConfigResponse()


@router.get("/get_server_capabilities", response_model=wire.ServerCapabilities)
def capabilities(service: ServiceDep) -> wire.ServerCapabilities:
    return wire.ServerCapabilities(
        supported_models=[wire.SupportedModel(model_name=name) for name in service.settings.base_models]
    )


@router.post("/create_session", response_model=wire.CreateSessionResponse)
async def create_session(request: Request, service: ServiceDep) -> wire.CreateSessionResponse:
    body, _ = await parse(request, wire.CreateSessionRequest)
    meta = {"tags": body.tags, "sdk_version": body.sdk_version, "display_name": body.display_name}
    sid = await run_in_threadpool(service.log.create_session, meta)
    m.REQUESTS.labels("create_session", "accepted").inc()
    return wire.CreateSessionResponse(session_id=sid, info_message=f"asyncrl tinker session {sid}")


@router.post("/session_heartbeat", response_model=wire.SessionHeartbeatResponse)
async def heartbeat(request: Request, service: ServiceDep) -> wire.SessionHeartbeatResponse:
    body, _ = await parse(request, wire.SessionHeartbeatRequest)
    session = await run_in_threadpool(service.log.session, body.session_id)
    if session is None:
        raise refuse(404, "session_heartbeat", f"unknown session_id {body.session_id[:64]!r}")
    if "finished" in session:  # the SDK stops its heartbeat loop on a 410
        raise refuse(
            410, "session_heartbeat", f"session {body.session_id} is finished ({session['finished']})"
        )
    await run_in_threadpool(service.log.heartbeat, body.session_id)
    return wire.SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish", response_model=None, status_code=204)
async def finish(session_id: str, request: Request, service: ServiceDep) -> None:
    body, _ = await parse(request, wire.SessionFinishRequest)
    reason = body.reason.type[:32] if body.reason else "unknown"
    await run_in_threadpool(service.finish_session, session_id, reason)


@router.post("/telemetry", response_model=wire.TelemetryResponse)
async def telemetry(request: Request) -> wire.TelemetryResponse:
    body, _ = await parse(request, wire.TelemetrySendRequest)
    m.TELEMETRY_EVENTS.inc(len(body.events))
    return wire.TelemetryResponse()
