"""FastAPI dependencies of the reward service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.reward.scoring import Scorer


def get_scorer(request: Request) -> Scorer:
    return request.app.state.scorer


ScorerDep = Annotated[Scorer, Depends(get_scorer)]
