"""FastAPI dependencies of the Tinker-compatible service."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from asyncrl.services.tinker.service import TinkerService

B = TypeVar("B", bound=BaseModel)


def get_service(request: Request) -> TinkerService:
    return request.app.state.service


ServiceDep = Annotated[TinkerService, Depends(get_service)]


async def parse(request: Request, model: type[B]) -> tuple[B, bytes]:
    """The body as `model` and its raw bytes (a call's fingerprint: a retry sends the same
    bytes). A body that does not validate gets the services' bounded 422 (runtime/limits.py)."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw), raw
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
