"""HTTP bodies of the rollout service's engine fleet (`GET/POST/DELETE /v1/engines`,
docs/architecture.md §7): the engines behind its sglang-router that it keeps at the current
weights."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.proto.states import EngineState

MAX_URL_CHARS = 2048


def engine_url(value: str) -> str:
    """An engine's base URL, `http(s)://host[:port]` (a trailing slash dropped); ValueError else."""
    url = value.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"an engine URL is http(s)://host[:port], got {value[:200]!r}")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"an engine URL is its base, with no path, query or credentials: {value[:200]!r}")
    return url


class EngineJoin(BaseModel):
    """`POST /v1/engines`: an engine to add to the fleet."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS, description="the engine's base URL")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return engine_url(value)


class FleetEngine(BaseModel):
    url: str
    state: EngineState
    version: int | None = Field(description="the policy version it serves as far as the rollout knows")
    since: float = Field(description="unix time it entered this state")
    error: str = Field("", description="why it is down, or why its last join failed")


class FleetEngines(BaseModel):
    """`GET /v1/engines` (and each change's answer: the engine changed)."""

    router: str
    engines: list[FleetEngine]
