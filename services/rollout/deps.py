"""FastAPI dependencies of the rollout service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from asyncrl.services.rollout.service import RolloutService


def get_service(request: Request) -> RolloutService:
    return request.app.state.service


ServiceDep = Annotated[RolloutService, Depends(get_service)]
