"""`/v1/engines`: the engine fleet behind the rollout's sglang-router (`router_url`;
`services/rollout/fleet.py`, docs/architecture.md §7): list it, add an engine, remove one.

`POST /v1/engines {"url"}` answers once the engine serves the current weights and the router
lists it (200, the engine; an engine already serving is left as it is), or refuses: 422 for the
fleet's router itself (it would route to itself and take weight updates), 409 when
there is no fleet (no `router_url`) or the engine cannot be brought to the current weights
(unreachable, a failed load, broadcast weights), 502 when the router did not take it, 503 while
the rollout has not caught up with the published weights since its start. `DELETE
/v1/engines?url=` takes it out of the router, then out of the weight updates (200, the fleet
after; 404 for an engine the fleet does not have). Behind the engine token whenever the rollout
holds one (`install_auth`'s `engine_control`): a join makes the rollout send it to the URL given.
Each refusal is counted in `asyncrl_rollout_requests_rejected_total{reason}`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from asyncrl.proto.fleet import MAX_URL_CHARS, EngineJoin, FleetEngine, FleetEngines, engine_url
from asyncrl.proto.rollout import ErrorBody
from asyncrl.services.rollout.clients.router import RouterError
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.engine_updates import JoinRefused
from asyncrl.services.rollout.fleet import EngineFleet, FleetNotReady, NotAMember, NotAnEngine
from asyncrl.services.rollout.routes.errors import ERRORS, refuse
from asyncrl.services.rollout.service import RolloutService

router = APIRouter(prefix="/v1/engines", tags=["engines"])

RESPONSES = {**ERRORS, 502: {"model": ErrorBody}}
CAUGHT_UP_WAIT_S = 10.0  # a join right after the start waits this long for the weights to be caught up with


def _fleet(service: RolloutService) -> EngineFleet:
    if service.fleet is None:
        raise refuse(
            409, "no engine fleet: set router_url to manage the engines behind an sglang-router", "no_fleet"
        )
    return service.fleet


@router.get("", response_model=FleetEngines, responses=RESPONSES)
async def listing(service: ServiceDep) -> FleetEngines:
    return _fleet(service).view()


@router.post("", response_model=FleetEngine, responses=RESPONSES)
async def join(body: EngineJoin, service: ServiceDep) -> FleetEngine:
    fleet = _fleet(service)
    try:
        return await fleet.join(body.url, CAUGHT_UP_WAIT_S)
    except NotAnEngine as exc:
        raise refuse(422, str(exc), "not_an_engine") from exc
    except JoinRefused as exc:
        raise refuse(409, f"{body.url} did not join: {exc}", "join_refused") from exc
    except RouterError as exc:
        raise refuse(502, f"{body.url} did not join: {exc}", "router_failed") from exc
    except FleetNotReady as exc:
        raise refuse(503, str(exc), "fleet_not_ready") from exc


@router.delete("", response_model=FleetEngines, responses=RESPONSES)
async def leave(
    service: ServiceDep, url: Annotated[str, Query(min_length=1, max_length=MAX_URL_CHARS)]
) -> FleetEngines:
    fleet = _fleet(service)
    try:
        url = engine_url(url)
    except ValueError as exc:
        raise refuse(422, str(exc), "invalid_body") from exc
    try:
        await fleet.leave(url)
    except NotAMember as exc:
        raise refuse(404, str(exc), "unknown_engine") from exc
    except RouterError as exc:
        raise refuse(502, f"{url} is still in the fleet: {exc}", "router_failed") from exc
    return fleet.view()
