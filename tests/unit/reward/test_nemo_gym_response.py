"""The `nemo_gym` verifier's pure parts: the completion as Responses API output items, and
failure kinds as bounded metric labels."""

from __future__ import annotations

import json

from asyncrl.services.reward.verifiers.nemo_gym import build_response, failure_label, response_output


def test_text_and_hermes_tool_calls_become_output_items_in_order():
    items = response_output(
        'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>nope</tool_call>'
    )
    assert [i["type"] for i in items] == ["message", "function_call", "message"]
    assert items[0]["content"] == [{"type": "output_text", "text": "a", "annotations": []}]
    assert (items[1]["name"], json.loads(items[1]["arguments"]), items[1]["call_id"]) == (
        "f",
        {"x": 1},
        "call_1",
    )
    assert items[2]["content"][0]["text"] == "b <tool_call>nope</tool_call>"  # not a call: stays text


def test_a_call_alone_has_no_message_and_an_empty_completion_one_empty_message():
    only_call = response_output('<tool_call>{"name": "g", "arguments": "raw"}</tool_call>')
    assert [(i["type"], i.get("arguments")) for i in only_call] == [("function_call", "raw")]
    empty = response_output("")
    assert [(i["type"], i["content"][0]["text"]) for i in empty] == [("message", "")]


def test_response_takes_model_and_tools_from_the_request():
    response = build_response(
        "hi", {"input": "q", "model": "m7", "tools": [{"type": "function", "name": "f"}]}
    )
    assert (response["object"], response["model"], response["tool_choice"]) == ("response", "m7", "auto")
    assert response["tools"] == [{"type": "function", "name": "f"}]
    assert build_response("hi", {"input": "q"})["model"] == "asyncrl-policy"


def test_failure_kinds_are_bounded_labels():
    assert [failure_label(k) for k in ("sandbox", "judge_failed", "gpu on fire", None, "", 7)] == [
        "sandbox",
        "judge_failed",
        "other",
        "unspecified",
        "unspecified",
        "other",
    ]
