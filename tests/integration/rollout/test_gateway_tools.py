"""`tool_choice` and `response_format` through the gateway on loopback: real Redis, the reference
engine (a tiny Qwen2 whose vocabulary has the characters of a hermes tool call), the rollout
service over HTTP and the real `openai` client; the other fixtures are test_gateway.py's.

The tiny model writes gibberish: the tests check what the gateway guarantees (a forced call
arrives as a tool call of the forced function, the prefill is prompt, never completion, the
recorded tokens and masks of each turn), not what the model says.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import test_gateway as gw
from test_gateway import CONTEXT, client_of, close, completion_ids, metric, open_session, take, tokenizer_with

from asyncrl.proto.openai import GatewayChatRequest
from asyncrl.services.ops.tinymodel import DEFAULT_CHARS, EOS_ID, build_tiny_model
from asyncrl.services.rollout.gateway.chat import _json_schema

engine, reward, start = gw.engine, gw.reward, gw.start  # test_gateway's fixtures, used by name
# Qwen-like: the tools listed up front, an assistant's calls written back in hermes form.
TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ '\\n' }}{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}{{ '\\n' }}</tool_call>{% endfor %}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
SEARCH = {"type": "function", "function": {"name": "search"}}
ASK = [{"role": "user", "content": "add 2 3>"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gateway_tools_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT, chars=DEFAULT_CHARS + '{}"_[]')
    return str(path)


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokenizer_with(model_dir, TOOL_TEMPLATE)


def prompt_of(tok, messages, tools, prefill="") -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text + prefill, add_special_tokens=False)["input_ids"]


def finish_of(ids: list[int], max_tokens: int, called: bool) -> str:
    if ids[-1] != EOS_ID and len(ids) == max_tokens:
        return "length"
    return "tool_calls" if called else "stop"


def test_a_named_tool_choice_is_a_call_of_that_function_and_its_prefill_is_prompt(
    start, tok, redis_url, run_id
):
    url = start(tok).url
    client = client_of(url)
    sid = open_session(url)["session_id"]
    prefill = '<tool_call>\n{"name": "calc", "arguments": '
    forced = client.chat.completions.create(model="tiny", messages=ASK, tools=[CALC, SEARCH], max_tokens=12, seed=3,
                                            tool_choice={"type": "function", "function": {"name": "calc"}},
                                            logprobs=True, extra_headers={"X-AsyncRL-Session": sid})  # fmt: skip
    first_prompt = prompt_of(tok, ASK, [CALC, SEARCH], prefill)
    c1 = completion_ids(tok, forced)
    [call] = forced.choices[0].message.tool_calls
    assert call.function.name == "calc" and call.type == "function"
    # the arguments are what the model wrote after the prefilled `"arguments": `, as it wrote them
    assert call.function.arguments in tok.decode(c1, skip_special_tokens=True)
    assert forced.usage.prompt_tokens == len(first_prompt) and forced.usage.completion_tokens == len(c1)
    assert forced.choices[0].finish_reason == finish_of(c1, 12, called=True)

    # the agent runs the tool and asks again, tools no longer offered
    messages = [*ASK, forced.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "content": "5", "tool_call_id": call.id}]  # fmt: skip
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=[CALC], tool_choice="none",
                                           max_tokens=6, seed=4, logprobs=True,
                                           extra_headers={"X-AsyncRL-Session": sid})  # fmt: skip
    second_prompt = prompt_of(tok, _as_rendered(messages), None)
    c2 = completion_ids(tok, plain)
    assert plain.usage.prompt_tokens == len(second_prompt)  # "none": the tools line is not rendered
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == tok.decode(c2, skip_special_tokens=True)
    assert close(url, sid, reward=1.0).json()["group"] == "buffered"

    [group] = take(redis_url, run_id, 1)
    # The prefill is the prompt's end: never completion, never trained on (it was not sampled).
    assert group.prompt_tokens.tolist() == first_prompt
    context = first_prompt + c1
    if second_prompt[: len(context)] == context:  # the template wrote the call back token for token
        [sample] = group.samples
        glue = second_prompt[len(context) :]
        assert sample.completion_ids.tolist() == c1 + glue + c2
        assert sample.loss_mask.tolist() == [1] * len(c1) + [0] * len(glue) + [1] * len(c2)
    else:  # it rewrote the call (its arguments as JSON): a new piece with its own prompt
        first, second = group.samples
        assert (first.completion_ids.tolist(), first.loss_mask.tolist()) == (c1, [1] * len(c1))
        assert (second.prompt_ids.tolist(), second.episode) == (second_prompt, 0)
        assert (second.completion_ids.tolist(), second.loss_mask.tolist()) == (c2, [1] * len(c2))


def _as_rendered(messages: list[dict]) -> list[dict]:
    """The messages as the gateway hands them to the template (content "" for none, arguments
    as objects when they are JSON)."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _json_or_text(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]  # fmt: skip
        out.append(m)
    return out


def _json_or_text(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def test_required_with_one_tool_calls_it(start, tok):
    client = client_of(start(tok).url)
    for choice in ("required", "any"):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[CALC], tool_choice=choice,
                                                max_tokens=10, seed=5, logprobs=True)  # fmt: skip
        [call] = answer.choices[0].message.tool_calls
        assert call.function.name == "calc"
        prefill = '<tool_call>\n{"name": "calc", "arguments": '
        assert answer.usage.prompt_tokens == len(prompt_of(tok, ASK, [CALC], prefill))


def test_required_among_tools_opens_a_call_and_counts_one_that_does_not_parse(start, tok):
    url = start(tok).url
    client = client_of(url)
    unmet = metric(url, "asyncrl_rollout_gateway_errors_total", route="chat", reason="tool_choice_unmet")
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[CALC, SEARCH], tool_choice="any",
                                            max_tokens=10, seed=6, logprobs=True)  # fmt: skip
    assert answer.usage.prompt_tokens == len(prompt_of(tok, ASK, [CALC, SEARCH], "<tool_call>\n"))
    text = tok.decode(completion_ids(tok, answer), skip_special_tokens=True)
    calls = answer.choices[0].message.tool_calls
    if calls:  # the model wrote a whole call
        assert {c.function.name for c in calls} <= {"calc", "search"}
    else:  # it did not: the text as written after the opening, counted
        assert answer.choices[0].message.content == "<tool_call>\n" + text
        assert (
            metric(url, "asyncrl_rollout_gateway_errors_total", route="chat", reason="tool_choice_unmet")
            == unmet + 1
        )


def test_tool_choice_refusals(start, tok):
    client = client_of(start(tok).url)
    with pytest.raises(openai.BadRequestError) as no_tools:
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    assert no_tools.value.param == "tool_choice" and "needs tools" in no_tools.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[CALC],
                                       tool_choice={"type": "function", "function": {"name": "search"}})  # fmt: skip
    assert "'search'" in unknown.value.message and "calc" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as odd:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[CALC], tool_choice="sometimes")
    assert "tool_choice" in odd.value.message


def test_response_format_reaches_the_engine_which_refuses_it_as_a_400(start, tok, engine):
    client = client_of(start(tok).url)
    before = metric(engine.url, "asyncrl_engine_requests_rejected_total", reason="invalid_input")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                {"type": "json_object"}):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, response_format=fmt)
        assert refused.value.status_code == 400 and refused.value.code == "engine_rejected"
        assert refused.value.param == "response_format"
        assert "constrained decoding (json_schema)" in refused.value.message
    assert metric(engine.url, "asyncrl_engine_requests_rejected_total", reason="invalid_input") == before + 2
    text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, seed=1,
                                          response_format={"type": "text"})  # fmt: skip
    assert text.choices[0].message.content is not None
    bad = httpx.post(
        f"{client.base_url}chat/completions",
        json={"messages": ASK, "response_format": {"type": "json_schema"}},
    )
    assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]


def test_response_format_as_sglang_json_schema_by_hand():
    def body(fmt):
        return GatewayChatRequest.model_validate({"messages": ASK, "response_format": fmt})

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    named = body({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert _json_schema(named) == '{"properties": {"x": {"type": "integer"}}, "type": "object"}'
    assert _json_schema(body({"type": "json_object"})) == '{"type": "object"}'
    assert _json_schema(body({"type": "text"})) is None
    assert _json_schema(GatewayChatRequest.model_validate({"messages": ASK})) is None
