"""OpenAI's chat completions bodies, the part asyncrl speaks, defined once for every user: the
rollout service's gateway (`POST /v1/chat/completions` of services/rollout/gateway.py), the
reference engine's endpoint of the same name (services/engine/app.py) and the judge verifier's
requests to an OpenAI-compatible server (services/reward/verifiers/judge.py).

What the models accept is the union of what the users serve: text content or text parts,
`function` tools, `tool_choice` auto or none, one choice, the sampled tokens' logprobs without
alternatives. Unknown request fields are kept (`model_extra`) so that a server refuses one that
would change the output instead of ignoring it. Each server's narrower checks are its own: the
gateway takes only OpenAI's five roles (`ROLES`, services/rollout/gateway.py
`check_request`); the reference engine renders text messages only and refuses tools, stop
strings and penalties (services/engine/app.py). Both refuse text that is not valid Unicode.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MOD = 2**63  # sampling seeds are below it (a resubmitted segment's seed wraps at it)
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles


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
    """One message; other fields (e.g. `reasoning_content`) are handed to the chat template.
    `role` is any name a chat template may know (OpenAI's are `ROLES`)."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
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
    """OpenAI's chat completion body; unknown fields are kept so that one changing the output is
    refused rather than ignored."""

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
        None, min_length=1, max_length=128, description="the gateway's session (or the X-Session-Id header)"
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
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] = Field(
        description="abort: the reference engine's request was aborted (a weight update)"
    )
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatCompletionUsage
