"""OpenAI's Responses API bodies, the part the gateway serves (`POST /v1/responses`,
services/rollout/gateway/responses.py), checked against the `openai` package's own models
(`openai.types.responses`, 3.57) and what `openai-agents` 0.24 sends.

A request is a conversation of input items: messages (`user`, `system`, `developer`,
`assistant`; content a string or `input_text` / `output_text` parts), the model's
`function_call`s and their `function_call_output`s, optionally continuing a stored response
(`previous_response_id`). Tools are function tools only, in the Responses' flat shape. Anything
else a client may set is kept untyped (`model_extra`) so that the gateway refuses it, naming it,
instead of ignoring it: built-in tools, images and files, background runs, conversations,
server-side truncation, reasoning settings.

The answer is a `response` (`ResponseObject`) whose output is a `message` (one `output_text`)
and / or `function_call` items; streamed, the same answer as Responses events
(`stream_events` in services/rollout/gateway/responses.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from asyncrl.proto.openai import SEED_MOD

INPUT_ROLES = ("user", "system", "developer", "assistant")


class TextContent(BaseModel):
    """A text part of a message: the client's (`input_text`) or the model's (`output_text`,
    echoed back with its annotations and logprobs, which are kept and not read)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message item; `type` may be left out (the SDK's `EasyInputMessage`). An echoed output
    message's `id` and `status` are kept and not read."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]


class FunctionCallItem(BaseModel):
    """The model's call of a function tool, as a previous response gave it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=128)
    arguments: str = ""


class FunctionCallOutput(BaseModel):
    """What the client's function returned for `call_id`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[TextContent]


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    """A function tool, flat (`{"type": "function", "name", ...}`, not chat's nested
    `function`). `strict` is accepted and not enforced: the gateway does not constrain
    decoding, so arguments are what the model wrote."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)


class TextFormat(BaseModel):
    """`text.format`: `text`, or a JSON schema / JSON object asked of the model."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_schema", "json_object"] = "text"


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """The body of `POST /v1/responses`. `seed` and `session_id` are asyncrl's own fields
    (as in chat: `extra_body`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = Field(None, min_length=1, max_length=128)
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_MOD)
    session_id: str | None = Field(None, min_length=1, max_length=128)


# --- the answer -------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A finished response (OpenAI's `Response`, the fields the gateway knows; the request's
    settings echoed as OpenAI echoes them)."""

    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputItem]
    usage: ResponsesUsage | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[FunctionTool] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False
