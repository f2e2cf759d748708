"""Tool calls read from the policy's text and environment answers as tokens (docs/architecture.md §12)."""

from __future__ import annotations

import pytest

from asyncrl.proto.rollout import EpisodeSpec
from asyncrl.services.ops.tinymodel import build_char_tokenizer
from asyncrl.services.rollout.groups.episodes import turn_stop_ids
from asyncrl.services.rollout.toolcalls import BadToolCall, ToolFormat, observation_ids, parse_tool_call

HERMES = ToolFormat.of(EpisodeSpec(environment="calculator"))
TINY = ToolFormat.of(EpisodeSpec(environment="secret", tool_format="tagged", tool_open="?", tool_close="",
                                 default_tool="lookup", observation_template="{observation}="))  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_hermes_calls_parse_to_name_and_arguments():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}\n</tool_call>'
    call = parse_tool_call(text, HERMES)
    assert (call.name, call.arguments) == ("calculator", {"expression": "2*(3+4)"})
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert parse_tool_call(as_string, HERMES).arguments == {"code": "print(1)"}
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"}</tool_call>'
    assert parse_tool_call(two, HERMES).name == "b"  # the turn's last call
    assert parse_tool_call("The answer is 14.", HERMES) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [('<tool_call>{"name": "calc"', "not closed"), ("<tool_call>{name: calc}</tool_call>", "not JSON"),
     ('<tool_call>{"arguments": {}}</tool_call>', '"name"'), ('<tool_call>["calc"]</tool_call>', '"name"'),
     ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "object")],
)  # fmt: skip
def test_unreadable_calls_are_bad_tool_calls(text, problem):
    with pytest.raises(BadToolCall, match=problem):
        parse_tool_call(text, HERMES)


def test_tagged_calls_and_their_stop_tokens(tokenizer):
    assert parse_tool_call("?", TINY).name == "lookup" and parse_tool_call("?", TINY).arguments == ""
    assert parse_tool_call("abc", TINY) is None
    tagged = ToolFormat.of(EpisodeSpec(environment="calculator", tool_format="tagged"))
    call = parse_tool_call("x <tool>calculator 2+2</tool>", tagged)
    assert (call.name, call.arguments) == ("calculator", "2+2")
    # `?` is one token: it ends the turn; `</tool>` is several: the turn runs to EOS
    assert turn_stop_ids(tokenizer, TINY) == tokenizer("?", add_special_tokens=False)["input_ids"]
    assert turn_stop_ids(tokenizer, tagged) == []


def test_observations_are_the_environment_text_tokenised(tokenizer, tmp_path):
    ids = observation_ids(tokenizer, TINY, "abc", after_eos=False)
    assert tokenizer.decode(ids) == "abc="
    # hermes: the chat template's `tool` turn and the next assistant header; the end of the
    # assistant turn is not written twice when the policy ended its turn with EOS itself
    ids = observation_ids(tokenizer, HERMES, "14", after_eos=True)
    assert tokenizer.decode(ids) == "\ntool: 14\nassistant: "
    tokenizer_with_eos_end = build_char_tokenizer(tmp_path)
    tokenizer_with_eos_end.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ended = observation_ids(tokenizer_with_eos_end, HERMES, "14", after_eos=True)
    not_ended = observation_ids(tokenizer_with_eos_end, HERMES, "14", after_eos=False)
    eos = tokenizer_with_eos_end.eos_token_id
    assert not_ended == [eos] + ended and ended[-1] != eos
