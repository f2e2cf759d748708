"""HTTP bodies of the environment protocol: episodes in which the policy calls tools.

An environment is served over HTTP (by the reward service, `services/reward/environments/`, or by
any server that speaks these bodies), in the shapes users know from OpenEnv (reset → observation;
step(action) → observation, reward, done) and NeMo Gym (`mask_sample`, `failure_kind`):

    GET  /v1/environments                  → EnvironmentList (name → description and tools)
    POST /v1/environments/{name}/reset     ResetRequest → ResetResponse
    POST /v1/environments/{name}/step      StepRequest  → StepResponse
    POST /v1/environments/{name}/reset_batch, …/step_batch: the same for many episodes at once

Environment replicas keep nothing between calls: whatever an episode's environment must
remember is in `state`, which every answer returns and the client sends back with the next
step. A replica that dies mid-episode therefore loses nothing (the client's retry goes to any
replica); a client (rollout replica) that dies restarts the episode whole, counted.

Two kinds of failure, never confused:
* the *tool* failed (a timeout, an exception in the user's code, a call that does not parse):
  the answer is 200 with `status` saying so and an `observation` the policy sees; the episode
  goes on;
* the *environment* failed (its infrastructure: a sandbox that cannot start, a crash): a 5xx
  (retried by the client), or a 200 with `mask_sample` true and a `failure_kind`: the episode
  is masked out of training and counted, never given a silent 0 reward.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_OBSERVATION_CHARS = 100_000  # on the wire; environments cap their own output lower
MAX_TURNS = 64


class ToolCall(BaseModel):
    """A tool the policy called: its name and arguments (a JSON object, or the raw text when the
    call's format carries no JSON)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class Action(BaseModel):
    """What the policy did in one turn: called a tool, or answered (`text`, no tool call)."""

    model_config = ConfigDict(extra="forbid")

    tool_call: ToolCall | None = None
    text: str | None = Field(default=None, max_length=MAX_OBSERVATION_CHARS)

    @model_validator(mode="after")
    def _one(self) -> Action:
        if (self.tool_call is None) == (self.text is None):
            raise ValueError("an action is exactly one of `tool_call` or `text`")
        return self


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: str = Field(min_length=1, max_length=256)
    seed: int = Field(default=0, ge=0, lt=2**63)
    prompt: str = Field(default="", max_length=MAX_OBSERVATION_CHARS)
    args: dict[str, Any] = Field(default_factory=dict)  # the environment's task arguments (from the job)


class ResetResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    observation: str = Field(
        default="", max_length=MAX_OBSERVATION_CHARS
    )  # the task: after a chat prompt a user message, else appended as text when not empty
    state: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI function schemas of the tools


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: str = Field(min_length=1, max_length=256)
    seed: int = Field(default=0, ge=0, lt=2**63)
    turn: int = Field(ge=0, lt=MAX_TURNS)
    args: dict[str, Any] = Field(default_factory=dict)
    state: dict[str, Any] = Field(default_factory=dict)
    action: Action


class StepStatus(StrEnum):
    """How the tool call went, as the policy is told (a failed tool is an observation)."""

    ok = "ok"
    tool_error = "tool_error"  # the tool ran and failed (an exception, a non-zero exit)
    timeout = "timeout"  # the tool ran out of time
    invalid_call = "invalid_call"  # no such tool, or arguments that do not fit it


class StepResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    observation: str = Field(default="", max_length=MAX_OBSERVATION_CHARS)
    # The environment's reward for this turn; None when it does not judge (a tool-only
    # environment, whose episodes a verifier scores).
    reward: float | None = None
    done: bool = False
    status: StepStatus = StepStatus.ok
    state: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    mask_sample: bool = False  # the environment failed: leave this episode out of training
    failure_kind: str | None = Field(default=None, max_length=128)

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be finite")
        return value


MAX_BATCH = 4096  # items of one batch call


class ResetBatch(BaseModel):
    """`POST /v1/environments/{name}/reset_batch`: many episodes' resets in one call (a rollout
    replica runs a step's worth of episodes at once); answered `{"results": [ResetResponse]}`."""

    model_config = ConfigDict(extra="forbid")

    items: list[ResetRequest] = Field(min_length=1, max_length=MAX_BATCH)


class StepBatch(BaseModel):
    """`POST /v1/environments/{name}/step_batch`, answered `{"results": [StepResponse]}` in order.
    An item whose step crashes is answered `mask_sample` with `failure_kind` "crash" (the
    others are not failed with it)."""

    model_config = ConfigDict(extra="forbid")

    items: list[StepRequest] = Field(min_length=1, max_length=MAX_BATCH)


class ResetResults(BaseModel):
    results: list[ResetResponse]


class StepResults(BaseModel):
    results: list[StepResponse]


class EnvironmentInfo(BaseModel):
    description: str = ""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    judges: bool = False  # its final step carries a reward (no verifier needed)


class EnvironmentList(BaseModel):
    environments: dict[str, EnvironmentInfo]
