"""OpenAI's chat completions bodies, the part asyncrl speaks, defined once for every user: the
rollout service's gateway (`POST /v1/chat/completions` of services/rollout/gateway/chat.py), the
reference engine's endpoint of the same name (services/engine/app.py) and the judge verifier's
requests to an OpenAI-compatible server (services/reward/verifiers/judge.py).

`ChatRequest` and `Message` are the fields every server here reads; every other request field
is kept untyped (`model_extra`) so that a server refuses one that would change its output
instead of ignoring it: the reference engine renders text messages only and refuses tools, stop
strings and penalties with a 400 naming them (services/engine/app.py). `GatewayChatRequest` and
`GatewayMessage` add what the gateway serves, typed: `function` tools, `tool_choice` (auto,
none, required, LangChain's any, or a named function), `response_format` (text, json_object,
json_schema), tool calls and answers in messages, stop strings, one choice, the sampled tokens'
logprobs without alternatives; it takes only OpenAI's five roles (`ROLES`,
services/rollout/gateway/chat.py `check_request`). Both refuse text that is not valid Unicode.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    """One message as the reference engine and the judge send it: a role and its content; other
    fields are kept and handed to the chat template. `role` is any name a chat template may know
    (OpenAI's are `ROLES`)."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None


class GatewayMessage(Message):
    """A message of an agent's conversation through the gateway: also the assistant's tool calls
    and the tool's answers, typed, since the gateway renders them into the sampled context."""

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


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the answer must call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # (`schema` shadows a BaseModel attribute: the field is `json_schema`, the wire name `schema`)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (the given schema). The gateway hands the last two to the engine as SGLang's
    `sampling_params.json_schema` (services/rollout/gateway/chat.py)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """OpenAI's chat completion body, the fields every server here reads. Every other field is
    kept (`model_extra`), untyped, so that a server refuses one that would change its output
    (the reference engine answers 400 naming it) instead of ignoring it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=1)
    logprobs: bool = False
    stream: bool = False


class GatewayChatRequest(ChatRequest):
    """The body the gateway serves: also tools, stop strings, penalties, stream options and the
    session, typed; its seeds stay below `SEED_MOD` (a resubmitted segment's seed wraps at it)."""

    messages: list[GatewayMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required", "any"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools), none (no tools offered), required or any (a tool call "
        "is forced), or a named function (that call is forced)",
    )
    response_format: ResponseFormat | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_MOD)
    top_logprobs: int | None = Field(
        None, ge=0, le=0, description="0 only: top alternatives are not returned"
    )
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    session_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="the gateway's session (or the X-AsyncRL-Session header)",
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    """`GET /v1/models`: the models the gateway serves (one: the policy)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
