"""Responses input items as chat messages, and answers as the `openai` SDK reads them (its own
`Response` and stream event models parse what the gateway sends)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from asyncrl.proto.openai import ChatCompletion
from asyncrl.proto.openai_responses import ResponsesRequest
from asyncrl.services.rollout.gateway.chat import GatewayError
from asyncrl.services.rollout.gateway.responses import (
    chat_request,
    check_responses_request,
    input_messages,
    response_of,
    stream_events,
)


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", **fields})


def test_items_become_one_assistant_turn_and_a_named_tool_message():
    body = request(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "be"}, {"type": "input_text", "text": "brief"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me add", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
    ])  # fmt: skip
    assert input_messages(body, []) == [
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "let me add"}],
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "2"},
    ]  # fmt: skip
    # an output whose call is in the stored history is named from it; one with no call is refused
    stored = [{"role": "assistant", "content": None,
               "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "mul", "arguments": "{}"}}]}]  # fmt: skip
    later = request(input=[{"type": "function_call_output", "call_id": "c9", "output": "6"}])
    assert input_messages(later, stored) == [
        {"role": "tool", "tool_call_id": "c9", "name": "mul", "content": "6"}
    ]
    with pytest.raises(GatewayError, match="no function_call with call_id 'c9'"):
        input_messages(later, [])


def test_the_chat_call_and_what_is_refused_under_responses_names():
    body = request(input="hi", tools=[{"type": "function", "name": "add", "strict": True}], max_output_tokens=7,
                   tool_choice="none")  # fmt: skip
    chat = chat_request(body, [{"role": "user", "content": "hi"}])
    assert (chat.max_completion_tokens, chat.tool_choice, chat.temperature, chat.top_p) == (
        7,
        "none",
        1.0,
        1.0,
    )
    assert chat.tools[0].function.name == "add" and chat.tools[0].function.model_extra == {"strict": True}
    schema = request(input="hi", text={"format": {"type": "json_object"}})  # chat's response_format
    assert chat_request(schema, [{"role": "user", "content": "hi"}]).response_format.type == "json_object"
    for fields, named in (({"background": True}, "background"), ({"include": ["reasoning.encrypted_content"]}, "include"),
                          ({"reasoning": {"effort": "low"}}, "reasoning")):  # fmt: skip
        with pytest.raises(GatewayError, match=named) as refused:
            check_responses_request(request(input="hi", **fields))
        assert refused.value.status == 400
    check_responses_request(request(input="hi", include=[], reasoning={"effort": None}, prompt_cache_key="k"))


def test_the_sdk_reads_the_answer_and_its_events():
    answer = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "created": 100, "model": "tiny",
        "choices": [{"finish_reason": "tool_calls", "message": {"content": "adding",
                     "tool_calls": [{"id": "call_7", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}})  # fmt: skip
    response, said = response_of(request(input="hi", metadata={"k": "v"}), answer)
    parsed = Response.model_validate(response.model_dump())
    assert parsed.output_text == "adding" and parsed.metadata == {"k": "v"}
    assert [(o.type, getattr(o, "call_id", None)) for o in parsed.output] == [
        ("message", None),
        ("function_call", "call_7"),
    ]
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (5, 9, 14)
    assert said == {"role": "assistant", "content": "adding",
                    "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}  # fmt: skip

    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(e.split("data: ", 1)[1])) for e in stream_events(response)]
    assert [e.sequence_number for e in events] == list(range(13))
    assert [e.type for e in events][8:11] == ["response.output_item.added", "response.function_call_arguments.delta",
                                              "response.function_call_arguments.done"]  # fmt: skip
    assert events[4].delta == "adding" and events[10].arguments == '{"a": 1}'
    assert events[-1].type == "response.completed" and events[-1].response.output[1].name == "add"
