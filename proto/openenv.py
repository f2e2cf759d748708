"""The OpenEnv protocol as the rollout service speaks it (openenv-core 0.3.0,
`openenv/core/env_server/http_server.py` and `types.py`): an env server made with `openenv
init` and started with uvicorn serves, at its root,

    GET  /schema   → {"action": JSON schema, "observation": …, "state": …}
    WS   /ws       one environment per connection, its state kept for the connection's life:
        client → {"type": "reset", "data": {seed?, episode_id?, …}}
                 {"type": "step",  "data": {action fields}}
                 {"type": "close"}
        server → {"type": "observation", "data": {"observation": {…}, "reward": x|null, "done": b}}
                 {"type": "error", "data": {"message": str, "code": str, …}}
    POST /reset, /step   the same bodies over HTTP (`{"action": {…}}` for a step), but each call
        builds a fresh environment: an episode over HTTP is stateless (one step sees no earlier one)

An `error` leaves the socket open (`VALIDATION_ERROR`: an action its model refused; any other
code: the environment failed). The observation dict carries neither reward, done nor
metadata (the server strips them). Only these messages are used: `state` and the MCP routes
(`/mcp`, `{"type": "mcp"}`) are not.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

OPENENV_VERSION = "0.3.0"  # the openenv-core release these shapes follow
VALIDATION_ERROR = "VALIDATION_ERROR"  # the server's code for an action its model refused
ACTION_METADATA = "metadata"  # every OpenEnv action's own field, not one the policy fills


class OpenEnvResult(BaseModel):
    """`data` of an `observation` message (and the body of `POST /reset`, `/step`)."""

    model_config = ConfigDict(extra="ignore")

    observation: dict[str, Any] = Field(default_factory=dict)
    reward: float | None = None
    done: bool = False

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be finite")
        return value


class OpenEnvMessage(BaseModel):
    """One message the server sends over `/ws`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["observation", "state", "error", "mcp"]
    data: dict[str, Any] = Field(default_factory=dict)


class OpenEnvSchema(BaseModel):
    """`GET /schema`."""

    model_config = ConfigDict(extra="ignore")

    action: dict[str, Any]
    observation: dict[str, Any] = Field(default_factory=dict)
    state: dict[str, Any] = Field(default_factory=dict)
