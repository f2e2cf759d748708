"""FastAPI dependencies of the reward service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from asyncrl.services.reward.environments.base import Environment
from asyncrl.services.reward.metrics import ENV_REJECTED
from asyncrl.services.reward.scoring import Scorer


def get_scorer(request: Request) -> Scorer:
    return request.app.state.scorer


ScorerDep = Annotated[Scorer, Depends(get_scorer)]


def get_environments(request: Request) -> dict[str, Environment]:
    return request.app.state.environments


def get_environment(name: str, request: Request) -> Environment:
    """The environment of the path's `{name}`; 404 (counted) for one this server does not serve."""
    env = request.app.state.environments.get(name)
    if env is None:
        ENV_REJECTED.labels("unknown_environment").inc()
        raise HTTPException(status_code=404, detail=f"unknown or disabled environment {name[:64]!r}")
    return env


EnvironmentsDep = Annotated[dict[str, Environment], Depends(get_environments)]
EnvironmentDep = Annotated[Environment, Depends(get_environment)]
