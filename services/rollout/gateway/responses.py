"""OpenAI's Responses API on the gateway (docs/architecture.md §12): an agent that speaks
`POST /v1/responses` (the `openai` SDK's `client.responses`, openai-agents' default model) is
trained like one that speaks chat completions.

    POST /v1/responses                          a Responses body; session as for chat
    POST /v1/sessions/{id}/v1/responses         the same, the session in the URL

A call is translated into a chat call and served by `Gateway.complete`, so it is rendered by
the policy's chat template, sampled and recorded token-exact exactly as a chat call is: input
messages become chat messages (`developer` as `system`, text parts joined), `instructions` a
first system message, `function_call` items the assistant's `tool_calls`, a
`function_call_output` a `tool` message, flat function tools chat's nested ones. The answer's
hermes tool calls become `function_call` items, the rest of its text one `output_text` message.

`previous_response_id` continues a stored conversation: each response with `store` (OpenAI's
default) keeps its conversation (without its `instructions`, which OpenAI does not carry over)
and its own answer in Redis (buffer/responses.py) for the sessions' TTL; the new input is
appended to it. An unknown, expired or unstored id is a 404. A client that sends the whole
conversation each time gets the same prompt, so the same recorded sample.

`stream` answers the finished response as Responses events (the engine does not stream: they
come once the answer is complete): `response.created`, `response.in_progress`, per output item
`response.output_item.added`, its text (`content_part.added`, `output_text.delta`,
`output_text.done`, `content_part.done`) or arguments (`function_call_arguments.delta`,
`.done`), `response.output_item.done`, then `response.completed`.

Not served (refused with a 400 naming the field): built-in tools (web search, file search,
computer, MCP, ...), image and file inputs, `background`, `conversation`, stored `prompt`s,
`truncation: auto`, reasoning settings, `include`d extras, `text.verbosity`. Not kept: a
response's retrieval (`GET /v1/responses/{id}`) and deletion. `strict` function schemas are not
enforced (no constrained decoding).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import redis
from pydantic import ValidationError

from asyncrl.buffer.responses import ResponseStore
from asyncrl.proto.openai import ChatCompletion, GatewayChatRequest
from asyncrl.proto.openai_responses import (
    FunctionCallItem,
    FunctionCallOutput,
    IncompleteDetails,
    InputMessage,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
    TextContent,
)
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.gateway.chat import Gateway, GatewayError, check_request

# Request fields that do not change what is generated (any other unknown field must be unset).
HARMLESS_FIELDS = frozenset(
    {
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "service_tier",
    }
)
# Chat field names in a refusal, as the Responses client named them.
CHAT_TO_RESPONSES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def check_responses_request(body: ResponsesRequest) -> None:
    """Refuse, naming it, what the gateway cannot do; what it can is checked again as a chat call."""
    extra = sorted(
        k
        for k, v in (body.model_extra or {}).items()
        if k not in HARMLESS_FIELDS and v not in (None, False, [], {}, "", 0)
    )
    if extra:
        raise GatewayError(400, f"not supported by the gateway: {extra[:10]}", "unsupported_field")
    if body.truncation == "auto":
        raise GatewayError(
            400, "truncation 'auto' is not supported: the gateway never drops input", "unsupported_field"
        )
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise GatewayError(
            400, "reasoning is not supported: the policy's chat template decides", "unsupported_field"
        )
    if body.text is not None and body.text.verbosity is not None:
        raise GatewayError(400, "text.verbosity is not supported", "unsupported_field")
    if body.include:
        raise GatewayError(400, f"include is not supported: {body.include[:10]}", "unsupported_field")


class Responses:
    """`POST /v1/responses` on a replica's `Gateway`; stored conversations in Redis."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.store = ResponseStore(gateway.store.buf, gateway.settings.gateway_session_ttl_s)

    async def create(self, body: ResponsesRequest, session_id: str | None) -> ResponseObject:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = await asyncio.to_thread(self.store.load, body.previous_response_id)
            if stored is None:
                raise GatewayError(
                    404,
                    f"no response {body.previous_response_id[:128]!r} (unknown, expired, or not stored)",
                    "unknown_response",
                )
            history = stored
            m.GATEWAY_RESPONSES.labels("continued").inc()
        conversation = history + input_messages(body, history)
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        chat = chat_request(body, system + conversation)
        answer, _ = await self.gateway.complete(chat, session_id)
        response, said = response_of(body, answer)
        m.GATEWAY_RESPONSES.labels("answered").inc()
        if body.store is not False:
            try:
                saved = await asyncio.to_thread(self.store.save, response.id, [*conversation, said])
            except redis.RedisError:  # the call is recorded already: answered, not stored (counted)
                saved = False
            m.GATEWAY_RESPONSES.labels("stored" if saved else "not_stored").inc()
            response.store = saved
        return response


def input_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input items as chat messages (GatewayMessage's fields). Function calls join
    the assistant message just before them (one turn: its text, then its calls); an output
    names its call's function (for templates that render it)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    names = {c["id"]: c["function"]["name"] for msg in history for c in msg.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            if item.call_id not in names:
                raise GatewayError(
                    400,
                    f"input.{i}: no function_call with call_id {item.call_id[:128]!r} before this output",
                    "invalid_body",
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "name": names[item.call_id],
                    "content": _text(item.output),
                }
            )
    return out


def _text(content: str | list[TextContent]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> GatewayChatRequest:
    """The chat call that serves `body`; what chat refuses is refused under the Responses name."""
    choice = body.tool_choice
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "seed": body.seed,
        "tools": [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
        if body.tools
        else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if choice is not None and not isinstance(choice, str)
        else choice,
    }
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":  # flat in Responses, nested in chat
        fields["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"})}
    try:
        chat = GatewayChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        check_request(chat)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"[:200] for e in exc.errors()[:5]]
        raise GatewayError(
            400, _responses_names("not supported by the gateway: " + "; ".join(parts)), "unsupported_field"
        ) from None
    except GatewayError as exc:
        raise GatewayError(exc.status, _responses_names(str(exc)), exc.reason, exc.retry_after) from None
    return chat


def _responses_names(message: str) -> str:
    for chat_name, name in CHAT_TO_RESPONSES.items():
        message = message.replace(chat_name, name)
    return message


def response_of(body: ResponsesRequest, answer: ChatCompletion) -> tuple[ResponseObject, dict[str, Any]]:
    """The chat answer as a `response`, and the assistant message it adds to the conversation
    (chat form, as the next call renders it)."""
    choice = answer.choices[0]
    cut = choice.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    content, calls = choice.message.content, choice.message.tool_calls or []
    output: list[OutputMessage | OutputFunctionCall] = []
    if content or not calls:
        output.append(
            OutputMessage(
                id=f"msg_{uuid.uuid4().hex}", status=status, content=[OutputText(text=content or "")]
            )
        )
    for call in calls:
        output.append(
            OutputFunctionCall(
                id=f"fc_{uuid.uuid4().hex}",
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status=status,
            )
        )
    said: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        said["tool_calls"] = [c.model_dump() for c in calls]
    choice_echo = body.tool_choice if body.tool_choice is not None else "auto"
    response = ResponseObject(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=answer.created,
        completed_at=time.time(),
        status=status,
        model=answer.model,
        output=output,
        usage=ResponsesUsage(
            input_tokens=answer.usage.prompt_tokens,
            output_tokens=answer.usage.completion_tokens,
            total_tokens=answer.usage.total_tokens,
        ),
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        store=body.store is not False,
        temperature=1.0 if body.temperature is None else body.temperature,
        text={"format": body.text.format.model_dump()}
        if body.text and body.text.format
        else {"format": {"type": "text"}},
        tool_choice=choice_echo if isinstance(choice_echo, str) else choice_echo.model_dump(),
        tools=body.tools or [],
        top_p=1.0 if body.top_p is None else body.top_p,
        user=body.user,
    )
    return response, said


def stream_events(response: ResponseObject) -> list[str]:
    """A finished response as the Responses stream (server-sent events, each `{"type",
    "sequence_number", ...}`): created, in progress, each output item added / its content /
    done, completed."""
    events: list[str] = []

    def emit(kind: str, **fields: Any) -> None:
        body = {"type": kind, "sequence_number": len(events), **fields}
        events.append(f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n")

    pending = response.model_copy(update={"status": "in_progress", "output": [], "usage": None,
                                          "completed_at": None, "incomplete_details": None})  # fmt: skip
    emit("response.created", response=pending.model_dump())
    emit("response.in_progress", response=pending.model_dump())
    for index, item in enumerate(response.output):
        done = item.model_dump()
        if isinstance(item, OutputMessage):
            emit(
                "response.output_item.added",
                output_index=index,
                item={**done, "status": "in_progress", "content": []},
            )
            for part_index, part in enumerate(item.content):
                where = {"item_id": item.id, "output_index": index, "content_index": part_index}
                emit("response.content_part.added", **where, part={**part.model_dump(), "text": ""})
                if part.text:
                    emit("response.output_text.delta", **where, delta=part.text, logprobs=[])
                emit("response.output_text.done", **where, text=part.text, logprobs=[])
                emit("response.content_part.done", **where, part=part.model_dump())
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**done, "status": "in_progress", "arguments": ""},
            )
            where = {"item_id": item.id, "output_index": index}
            if item.arguments:
                emit("response.function_call_arguments.delta", **where, delta=item.arguments)
            emit("response.function_call_arguments.done", **where, arguments=item.arguments, name=item.name)
        emit("response.output_item.done", output_index=index, item=done)
    emit("response.incomplete" if response.status == "incomplete" else "response.completed",
         response=response.model_dump())  # fmt: skip
    return events
