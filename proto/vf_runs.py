"""Bodies of the gateway's verifiers runs (services/rollout/gateway/vf_runs.py says what they do).

* `POST /v1/runs/{run}/v1/chat/completions`: an OpenAI chat call (proto/openai.py); the rollout
  is the `X-Session-ID` header verifiers sends (its trace id).
* `POST /v1/runs/{run}/groups`: `VfGroupRequest` → `VfGroupClosed`: the rollouts of one
  verifiers group, each with the reward verifiers gave it or the error it ended with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.proto.gateway import ID_PATTERN
from asyncrl.proto.limits import MAX_GROUP_SIZE

MAX_RUN_ID_CHARS = 60  # `{run}.{trace}` must fit a session id (128) with verifiers' 32-char trace ids
MAX_TRACE_ID_CHARS = 64
MAX_GROUP_KEY_CHARS = 64  # `{run}.g.{group}` must fit a group id (128)
MAX_ERROR_CHARS = 500


class VfRollout(BaseModel):
    """One rollout as verifiers ended it: a `reward` (its `Trace.reward`), or the `error` that
    failed it (then the whole group fails)."""

    model_config = ConfigDict(extra="forbid")

    trace_id: str = Field(min_length=1, max_length=MAX_TRACE_ID_CHARS, pattern=ID_PATTERN)
    reward: float | None = Field(None, allow_inf_nan=False)
    error: str | None = Field(None, max_length=MAX_ERROR_CHARS)

    @model_validator(mode="after")
    def _one_outcome(self) -> VfRollout:
        if (self.reward is None) == (self.error is None):
            raise ValueError("give exactly one of reward and error")
        return self


class VfGroupRequest(BaseModel):
    """Body of `POST /v1/runs/{run}/groups`. `group_id` is the client's name for the group
    (the same request again is answered as the first was, not buffered twice)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str = Field(min_length=1, max_length=MAX_GROUP_KEY_CHARS, pattern=ID_PATTERN)
    prompt_id: str | None = Field(None, min_length=1, max_length=128, pattern=ID_PATTERN)
    rollouts: list[VfRollout] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    num_rollouts: int | None = Field(
        None, ge=1, le=MAX_GROUP_SIZE, description="the run's rollouts per task: fewer named fails the group"
    )


class VfGroupClosed(BaseModel):
    group_id: str
    group: Literal["buffered", "duplicate", "failed"]
    reason: str | None = Field(None, description="why the group failed")
    dropped: int = Field(0, description="sessions of the failed group dropped (their calls discarded)")
