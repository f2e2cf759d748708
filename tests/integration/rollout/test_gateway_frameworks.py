"""Real agent frameworks' tool loops through the gateway: smolagents (`OpenAIModel`, whose
default `tool_choice` is "required") and LangChain (`ChatOpenAI.bind_tools` with
`tool_choice="any"` or a name, `with_structured_output`), each installed in a venv of its own
(tests/thirdparty.py) and run as a subprocess against the live rollout service on loopback;
real Redis and the reference engine (test_gateway.py's and test_gateway_tools.py's fixtures).

The clients are short scripts kept here as strings, written to a file and run with the venv's
python (a `.py` file of them in the tree would import packages that the static dependency check
expects pyproject to declare). The tiny model writes gibberish: the tests check what the gateway guarantees (a forced
call arrives as a tool call of that function, the recorded tokens and masks of each turn), not
what the model says.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import test_gateway as gw
import test_gateway_tools as gw_tools
from test_gateway import close, take, tokenizer_with
from test_gateway_tools import TOOL_TEMPLATE
from thirdparty import thirdparty_venv

# `make test-extended` (.ci/run's second stage): builds smolagents' and langchain-openai's venvs
pytestmark = pytest.mark.extended

# the fixtures used by name: test_gateway's, with test_gateway_tools' model (a hermes-ready vocabulary)
engine, reward, start, model_dir = gw.engine, gw.reward, gw.start, gw_tools.model_dir
SMOLAGENTS = ["smolagents[openai]==1.26.0"]
LANGCHAIN = ["langchain-openai==1.7.4"]

SMOLAGENTS_LOOP = r'''
import json, sys
from smolagents import OpenAIModel, tool
from smolagents.models import ChatMessage, MessageRole

@tool
def add(a: int, b: int) -> int:
    """adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b

model = OpenAIModel(model_id="tiny", api_base=sys.argv[1], api_key="x", client_kwargs={"max_retries": 0},
                    max_tokens=12, temperature=1.0, seed=7, logprobs=True)
ask = [ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": "add 2 3>"}])]
first = model.generate(ask, tools_to_call_from=[add])  # smolagents' own default: tool_choice="required"
call = first.tool_calls[0]
observation = ChatMessage(role=MessageRole.TOOL_RESPONSE, content=[{"type": "text", "text": "observation: 5"}])
second = model.generate([*ask, first, observation])
print(json.dumps({"tool": call.function.name, "raw": [first.raw.model_dump(), second.raw.model_dump()]}))
'''

LANGCHAIN_LOOP = r'''
import json, sys
import openai
from pydantic import BaseModel
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

@tool
def add(a: int, b: int) -> int:
    """adds two numbers"""
    return a + b

@tool
def search(query: str) -> str:
    """searches the web"""
    return query

class Sum(BaseModel):
    total: int

def llm(base):
    return ChatOpenAI(model="tiny", base_url=base, api_key="x", max_retries=0, max_tokens=12, temperature=1.0,
                      seed=9, logprobs=True)

def seen(message):
    meta = message.response_metadata
    return {"names": [c["name"] for c in message.tool_calls + message.invalid_tool_calls],
            "usage": meta["token_usage"], "tokens": [t["token"] for t in meta["logprobs"]["content"]]}

session, plain = llm(sys.argv[1]), llm(sys.argv[2])
ask = [HumanMessage("add 2 3>")]
first = session.bind_tools([add], tool_choice="any").invoke(ask)
call_id = (first.tool_calls + first.invalid_tool_calls)[0]["id"]
second = session.invoke([*ask, first, ToolMessage("5", tool_call_id=call_id)])
out = {"loop": [seen(first), seen(second)],
       "named": seen(plain.bind_tools([add, search], tool_choice="search").invoke([HumanMessage("find x>")]))}
try:
    plain.with_structured_output(Sum).invoke("add 2 3>")  # method="json_schema", LangChain's default
    out["json_schema"] = "accepted"
except openai.BadRequestError as exc:
    out["json_schema"] = {"status": exc.status_code, "code": exc.code, "param": exc.param, "message": exc.message}
by_call = plain.with_structured_output(Sum, method="function_calling", include_raw=True).invoke("add 2 3>")
out["function_calling"] = [c["name"] for c in by_call["raw"].tool_calls + by_call["raw"].invalid_tool_calls]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokenizer_with(model_dir, TOOL_TEMPLATE)


def run_client(requirements: list[str], name: str, script: str, folder, *args: str) -> dict:
    """Run `script` as a file (smolagents' @tool reads its function's source) with the venv's python."""
    python = thirdparty_venv(name, requirements)
    path = folder / f"{name}_client.py"
    path.write_text(script)
    done = subprocess.run([str(python), str(path), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ids_of(tok, tokens: list[str]) -> list[int]:
    """Token ids of the answer's `logprobs.content` tokens (the tiny tokenizer: one id each)."""
    out = []
    for text in tokens:
        [one] = tok(text, add_special_tokens=False)["input_ids"]
        out.append(one)
    return out


def assert_recorded(tok, group, turns: list[tuple[int, list[int]]], prefill: str) -> None:
    """The group's one session as the gateway recorded it: `turns` (prompt length, completion
    ids) of each call; the first prompt ends with the forced call's prefill (prompt, not
    completion); each completion is the model's own tokens, loss mask 1; a prompt that extends
    the previous context adds glue of mask 0, one that does not starts a new piece."""
    (p1, c1), (p2, c2) = turns
    prompt = group.prompt_tokens.tolist()
    assert len(prompt) == p1
    opening = tok(prefill, add_special_tokens=False)["input_ids"]
    assert prompt[-len(opening) :] == opening
    first = group.samples[0]
    assert first.completion_ids.tolist()[: len(c1)] == c1
    if len(group.samples) == 1:  # the second prompt was the first context + glue
        glue = p2 - p1 - len(c1)
        assert first.completion_ids.tolist()[len(c1) + glue :] == c2
        assert first.loss_mask.tolist() == [1] * len(c1) + [0] * glue + [1] * len(c2)
    else:
        first, second = group.samples
        assert (first.completion_ids.tolist(), first.loss_mask.tolist()) == (c1, [1] * len(c1))
        assert (len(second.prompt_ids), second.episode) == (p2, 0)
        assert (second.completion_ids.tolist(), second.loss_mask.tolist()) == (c2, [1] * len(c2))


def test_smolagents_tool_loop_through_the_gateway(start, tok, redis_url, run_id, tmp_path):
    url = start(tok).url
    out = run_client(SMOLAGENTS, "smolagents", SMOLAGENTS_LOOP, tmp_path, f"{url}/v1/sessions/smol-1/v1")
    first, second = out["raw"]
    # "required" with one tool offered forces that tool: it arrives as smolagents' tool call
    assert out["tool"] == "add"
    assert [c["function"]["name"] for c in first["choices"][0]["message"]["tool_calls"]] == ["add"]
    assert second["choices"][0]["message"]["tool_calls"] is None  # no tools offered: plain text
    assert close(url, "smol-1", reward=1.0).json()["group"] == "buffered"
    [group] = take(redis_url, run_id, 1)
    turns = [
        (
            r["usage"]["prompt_tokens"],
            ids_of(tok, [t["token"] for t in r["choices"][0]["logprobs"]["content"]]),
        )
        for r in out["raw"]
    ]
    assert [len(c) for _, c in turns] == [r["usage"]["completion_tokens"] for r in out["raw"]]
    assert_recorded(tok, group, turns, '<tool_call>\n{"name": "add", "arguments": ')


def test_langchain_tool_loop_and_structured_output_through_the_gateway(
    start, tok, redis_url, run_id, tmp_path
):
    url = start(tok).url
    out = run_client(
        LANGCHAIN, "langchain-openai", LANGCHAIN_LOOP, tmp_path, f"{url}/v1/sessions/lc-1/v1", f"{url}/v1"
    )
    first, second = out["loop"]
    assert first["names"] == ["add"]  # tool_choice="any" (sent as "required"), one tool: that one
    assert second["names"] == []
    assert out["named"]["names"] == ["search"]  # a named choice among two tools
    # json_schema needs constrained decoding, which the reference engine refuses: a clear 400
    assert out["json_schema"]["status"] == 400 and out["json_schema"]["param"] == "response_format"
    assert out["json_schema"]["code"] == "engine_rejected" and "json_schema" in out["json_schema"]["message"]
    assert out["function_calling"] == ["Sum"]  # the schema as a forced tool call instead
    assert close(url, "lc-1", reward=0.0).json()["group"] == "buffered"
    [group] = take(redis_url, run_id, 1)  # only the session's two calls: the others had none
    turns = [(t["usage"]["prompt_tokens"], ids_of(tok, t["tokens"])) for t in out["loop"]]
    assert [len(c) for _, c in turns] == [t["usage"]["completion_tokens"] for t in out["loop"]]
    assert_recorded(tok, group, turns, '<tool_call>\n{"name": "add", "arguments": ')
