"""Bodies of the rollout service's OpenAI-compatible gateway (services/rollout/gateway.py says
what it does), and the record of one chat call it keeps in Redis.

* `POST /v1/sessions`: `SessionRequest` → `SessionCreated`.
* `POST /v1/sessions/{id}/reward`: `SessionReward` → `SessionClosed`.
* `POST /v1/chat/completions`: `ChatRequest` → `ChatCompletion` (or its chunks,
  `services.rollout.gateway.sse_chunks`). These follow OpenAI's chat completions API, the part
  the gateway serves: text content (or text parts), `function` tools, `tool_choice` auto or
  none, one choice, the sampled tokens' logprobs without alternatives. Unknown request fields
  are kept (`model_extra`) so that the gateway refuses one that would change the output
  instead of ignoring it (`services.rollout.gateway.check_request`).
* `Call`: one chat call of a session as sampled (token ids, behaviour logprobs, the policy
  version of every token), written by the replica that served it and read by whichever
  replica builds the group (buffer/sessions.py stores it).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.proto.records import FinishReason, RewardStatus
from asyncrl.proto.rewards import RewardSpec
from asyncrl.proto.sglang import ChatCompletionUsage

SEED_MOD = 2**63  # sampling seeds are below it (a resubmitted segment's seed wraps at it)
ID_PATTERN = r"^[A-Za-z0-9._-]+$"  # group, prompt and session ids (they name Redis keys)


# --- sessions -------------------------------------------------------------------------------


class SessionRequest(BaseModel):
    """Body of `POST /v1/sessions`. Sessions with one `group_id` form one group of
    `group_size`; its `prompt_id` and `reward_spec` are its first session's (a later session
    naming others is refused)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=ID_PATTERN, description="default: a new group"
    )
    group_size: int = Field(1, ge=1, le=MAX_GROUP_SIZE)
    prompt_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=ID_PATTERN, description="default: the group id"
    )
    reward_spec: RewardSpec | None = Field(
        None, description="scores the session's last answer when it is closed without a reward"
    )


class SessionCreated(BaseModel):
    session_id: str
    group_id: str
    index: int = Field(description="position of the session in its group")


class SessionReward(BaseModel):
    """Body of `POST /v1/sessions/{id}/reward`: the session's reward, or nothing to have the
    session's `reward_spec` verifier score its last answer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float | None = None


class SessionClosed(BaseModel):
    session_id: str
    group_id: str
    reward: float | None
    reward_status: RewardStatus
    group: Literal["open", "buffered", "duplicate", "failed"] = Field(
        description="open: sessions of the group are still open; buffered: this close completed the group, now "
        "in the buffer; duplicate: it was put before; failed: it could not be built (logged, counted)"
    )


# --- chat completions ------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str = ""


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One message; other fields (e.g. `reasoning_content`) are handed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """OpenAI's chat completion body, the part the gateway serves; unknown fields are kept so
    that one changing the output is refused rather than ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = Field(
        None, description="auto (the default with tools) or none"
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=SEED_MOD)
    n: int = Field(1, ge=1, le=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=0, description="0 only: top alternatives are not returned"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    session_id: str | None = Field(
        None, min_length=1, max_length=128, description="or the X-Session-Id header"
    )


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatCompletionUsage


# --- the record of a chat call ----------------------------------------------------------------


class Call(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat call of a session as stored in Redis (msgpack): token arrays as little-endian
    int32 / float32 bytes."""

    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes  # behaviour log μ of each completion token
    versions: bytes  # policy version of each completion token
    lineage: dict[int, int]  # epoch -> newest version that sampled a token of this call
    finish_reason: FinishReason
    text: str
    started: float
    finished: float

    @classmethod
    def of(
        cls, prompt: list[int], tokens: list[int], logprobs: list[float], versions: list[int], **fields
    ) -> Call:
        return cls(
            prompt_ids=np.asarray(prompt, "<i4").tobytes(),
            completion_ids=np.asarray(tokens, "<i4").tobytes(),
            logprobs=np.asarray(logprobs, "<f4").tobytes(),
            versions=np.asarray(versions, "<i4").tobytes(),
            **fields,
        )

    def arrays(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """(prompt ids, completion ids, logprobs, versions) as lists."""
        return (
            np.frombuffer(self.prompt_ids, "<i4").tolist(),
            np.frombuffer(self.completion_ids, "<i4").tolist(),
            np.frombuffer(self.logprobs, "<f4").tolist(),
            np.frombuffer(self.versions, "<i4").tolist(),
        )
