"""An OpenEnv action schema as the policy's tool, calls as action dicts, observations as text,
and the task as a chat user message (services/rollout/groups/openenv.py, toolcalls.py).

The schema is the one openenv-core 0.3.0's `GET /schema` serves for `openenv init`'s echo env
(pydantic's `model_json_schema()` of its action), copied from a live server.
"""

from __future__ import annotations

import pytest

from asyncrl.proto.openenv import OpenEnvSchema
from asyncrl.services.ops.tinymodel import build_char_tokenizer
from asyncrl.services.rollout.groups.openenv import ActionTool, observation_text
from asyncrl.services.rollout.toolcalls import BadToolCall, ToolFormat, user_turn_ids

ECHO_ACTION = {
    "additionalProperties": False,
    "description": "Action for the Counter environment - just a message to echo.",
    "properties": {
        "metadata": {"additionalProperties": True, "title": "Metadata", "type": "object"},
        "message": {"description": "Message to echo back", "title": "Message", "type": "string"},
    },
    "required": ["message"],
    "title": "CounterAction",
    "type": "object",
}
GRID_ACTION = {
    "properties": {
        "metadata": {"type": "object"},
        "move": {"enum": ["up", "down"], "type": "string"},
        "steps": {"type": "integer"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
    },
    "required": ["move", "steps"],
    "type": "object",
}
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
TAGGED = ToolFormat("tagged", "?", ".")


def tool(action: dict, name: str = "echo") -> ActionTool:
    return ActionTool.of(name, OpenEnvSchema(action=action))


def test_the_tool_is_the_action_without_its_metadata():
    assert tool(ECHO_ACTION).openai() == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Action for the Counter environment - just a message to echo.",
            "parameters": {
                "type": "object",
                "properties": {"message": ECHO_ACTION["properties"]["message"]},
                "required": ["message"],
            },
        },
    }


def test_hermes_calls_become_action_dicts():
    echo = tool(ECHO_ACTION)
    call = '<tool_call>{"name": "echo", "arguments": {"message": "hi"}}</tool_call>'
    assert echo.action("I will say hi. " + call, HERMES) == {"message": "hi"}
    assert echo.action("no call here", HERMES) is None
    with pytest.raises(BadToolCall, match="no tool 'shout'; the tool is 'echo'"):
        echo.action('<tool_call>{"name": "shout", "arguments": {"message": "hi"}}</tool_call>', HERMES)
    # arguments as a bare string: the one string field
    assert echo.action('<tool_call>{"name": "echo", "arguments": "hey"}</tool_call>', HERMES) == {
        "message": "hey"
    }


def test_tagged_calls_are_a_json_object_or_the_one_string_field():
    assert tool(ECHO_ACTION).action("ab?hello there.", TAGGED) == {"message": "hello there"}
    grid = tool(GRID_ACTION, "grid")
    assert grid.action('?{"move": "up", "steps": 2}.', TAGGED) == {"move": "up", "steps": 2}
    with pytest.raises(BadToolCall, match=r"takes the fields \['move', 'note', 'steps'\]"):
        grid.action("?up 2.", TAGGED)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [({"move": "up"}, r"missing action fields \['steps'\]"),
     ({"move": "up", "steps": 1, "speed": 3}, r"unknown action fields \['speed'\]"),
     ({"move": "up", "steps": 1, "metadata": {}}, r"unknown action fields \['metadata'\]"),
     ({"move": "up", "steps": "1"}, "'steps' must be integer, got str"),
     ({"move": "up", "steps": True}, "'steps' must be integer, got bool"),
     ({"move": "left", "steps": 1}, r"'move' must be one of \['up', 'down'\]"),
     ({"move": "up", "steps": 1, "note": 5}, "'note' must be string or null, got int")],
)  # fmt: skip
def test_actions_that_do_not_fit_the_schema_are_refused_before_sending(fields, problem):
    with pytest.raises(BadToolCall, match=problem):
        tool(GRID_ACTION, "grid").check(fields)


def test_a_fitting_action_passes_the_check():
    tool(GRID_ACTION, "grid").check({"move": "down", "steps": 3, "note": None})
    tool(GRID_ACTION, "grid").check({"move": "down", "steps": 3, "note": "fast"})


def test_observations_read_as_text():
    assert observation_text({"echoed_message": "hi"}) == "hi"
    assert observation_text({"board": [1, 2]}) == "[1, 2]"
    assert (
        observation_text({"echoed_message": "hi", "message_length": 2})
        == '{"echoed_message": "hi", "message_length": 2}'
    )
    assert observation_text({}) == ""


QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, QWEN_LIKE])
def test_the_task_is_a_user_message_of_the_chat_template(tmp_path, template):
    """Prompt (the chat without its generation prompt) + the task's tokens == the template's
    rendering of the chat with the task appended as a user message, generation prompt on."""
    tok = build_char_tokenizer(tmp_path, chars="abcdefghijklmnopqrstuvwxyz <>|_\n:")
    if template is not None:
        tok.chat_template = template
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(chat, tokenize=False)
    with_task = tok.apply_chat_template(chat + [{"role": "user", "content": "find x"}], add_generation_prompt=True,
                                        tokenize=False)  # fmt: skip
    ids = tok(prompt, add_special_tokens=False)["input_ids"] + user_turn_ids(tok, "find x")
    assert ids == tok(with_task, add_special_tokens=False)["input_ids"]
    # no task: only the assistant header
    opened = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tok.decode(user_turn_ids(tok, "")) == opened[len(prompt) :]
