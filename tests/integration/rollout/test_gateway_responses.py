"""The gateway's Responses API end to end on loopback: real Redis (fixture), the reference
engine (uvicorn thread) serving a tiny Qwen2, the real reward service, the rollout service over
HTTP, the real `openai` client, and `openai-agents` 0.24 in its own venv running an Agent on its
default (Responses) model. Nothing is mocked.

A random tiny model writes gibberish, never a tool call, and the reference engine has no
constrained decoding to force one. So the module's model is a tiny Qwen2 trained here, on the
CPU in about a minute, to answer `call: ` with one hermes tool call (`add` of 2 and 3) and
`answer: ` with `ok`; its chat template writes `call: ` before an assistant turn that follows a
user and `answer: ` before one that follows a tool result, both in the history and as the
generation prompt, and `<eos>` after each assistant turn, so every prompt extends the last one
token-exact. Generation is greedy, so the same prompt gives the same tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import textwrap

import httpx
import openai
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import serve_in_thread, start_reward_service
from thirdparty import thirdparty_venv

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
from asyncrl.services.ops.tinymodel import DEFAULT_CHARS, EOS_ID, build_tiny_model

torch.set_num_threads(1)

CONTEXT = 256
CAP = 96
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
# `call: ` after a user (or system) message, `answer: ` after a tool result; <eos> ends a turn.
TOOL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'tool' %}answer: {% else %}call: {% endif %}"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<eos>{{ '\\n' }}{% else %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages[-1]['role'] == 'tool' %}answer: {% else %}call: {% endif %}{% endif %}"
)
ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
TRAIN_STEPS = 150  # the loss is below 0.05 by then (seeded: the same model every run)


def train_tool_caller(path) -> None:
    """A tiny Qwen2 taught the two answers above, on random lowercase context (so the test's
    own instructions and questions are in distribution)."""
    model, tok = build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT, chars=DEFAULT_CHARS + '{}"_')
    rng = random.Random(0)

    def words() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz >") for _ in range(rng.randint(1, 20)))

    def example() -> tuple[str, str]:
        context = f"system: {words()}\nuser: {words()}\n"
        if rng.random() < 0.5:
            return context + "call: ", CALL + "<eos>"
        return context + f"call: {CALL}<eos>\ntool: {rng.randint(0, 999)}\nanswer: ", "ok<eos>"

    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3)
    model.train()
    for _ in range(TRAIN_STEPS):
        ids, labels = [], []
        for prompt, completion in (example() for _ in range(8)):
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            c = tok(completion, add_special_tokens=False)["input_ids"]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        n = max(map(len, ids))
        batch = torch.tensor([x + [0] * (n - len(x)) for x in ids])
        target = torch.tensor([y + [-100] * (n - len(y)) for y in labels])
        mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in ids])
        loss = model(input_ids=batch, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_caller")
    train_tool_caller(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def engine(model_dir):
    running = serve_engine(model_dir, max_running_requests=16, max_new_tokens_cap=CAP, context_length=CONTEXT)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    running = start_reward_service(log_path=tmp_path_factory.mktemp("reward") / "reward.log")
    yield running
    running.stop()


@pytest.fixture
def url(redis_url, run_id, engine, reward, model_dir, tok):
    """A rollout service on this test's run, its gateway rendering with `TOOL_TEMPLATE`."""
    AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=64, max_staleness=0)
    running = serve_in_thread(redis_url, loaded_tokenizer=tok, run=run_id, replica="r0", engine_urls=engine.url,
                              reward_url=reward.url, tokenizer=model_dir, max_new_tokens_cap=CAP,
                              default_max_new_tokens=8, weights_poll_s=0.5, engine_backoff_s=0.05)  # fmt: skip
    yield running.url
    running.stop()


def client_of(base: str, **headers) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base, api_key="x", max_retries=0, timeout=60, default_headers=headers or None
    )


def render(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def close(url: str, sid: str, reward: float) -> dict:
    resp = httpx.post(f"{url}/v1/sessions/{sid}/reward", json={"reward": reward}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def take_one(redis_url: str, run_id: str):
    buf = Buffer(redis_url, run_id)
    [group] = Groups(buf, "test-trainer").take(1, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                               block_ms=5000).groups  # fmt: skip
    return group


def metric(url: str, name: str, **labels) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


SYSTEM = {"role": "system", "content": "you add"}
QUESTION = {"role": "user", "content": "add two and three"}
TOOL_TURN = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}  # fmt: skip
TOOL_RESULT = {"role": "tool", "content": "5"}


# --------------------------------------------------------------------------- the openai client


def test_a_function_call_turn_is_one_sample_both_ways(url, tok, redis_url, run_id):
    """Two sessions of one group run the same tool turn: one continues with
    `previous_response_id`, the other sends the whole conversation again. Both prompts are the
    same tokens, so both samples are: the call, the tool result (masked), the answer."""
    group = {"X-AsyncRL-Group": "resp-grp", "X-AsyncRL-Group-Size": "2"}
    continued = client_of(f"{url}/v1/sessions/by-id/v1", **group)
    resent = client_of(f"{url}/v1/sessions/by-input/v1", **group)
    first = {"model": "tiny", "instructions": "you add", "input": "add two and three", "tools": [ADD_TOOL],
             "temperature": 0.0, "max_output_tokens": 80}  # fmt: skip
    answers = {}
    for name, client in (("by-id", continued), ("by-input", resent)):
        one = client.responses.create(**first)
        [call] = one.output
        assert (call.type, call.name, json.loads(call.arguments), call.status) == (
            "function_call", "add", {"a": 2, "b": 3}, "completed")  # fmt: skip
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        prompt = render(tok, [SYSTEM, QUESTION])
        assert (one.usage.input_tokens, one.usage.output_tokens) == (len(prompt), len(ids(tok, CALL)) + 1)
        assert one.status == "completed" and one.tools[0].name == "add" and one.tool_choice == "auto"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        if name == "by-id":
            two = client.responses.create(model="tiny", instructions="you add", previous_response_id=one.id,
                                          input=[result], tools=[ADD_TOOL], temperature=0.0, max_output_tokens=80)  # fmt: skip
            assert two.previous_response_id == one.id
        else:
            echoed = [item.model_dump(exclude_none=True) for item in one.output]
            two = client.responses.create(model="tiny", instructions="you add", tools=[ADD_TOOL], temperature=0.0,
                                          input=[QUESTION, *echoed, result], max_output_tokens=80)  # fmt: skip
        assert two.output_text == "ok" and two.output[0].type == "message"
        assert two.usage.input_tokens == len(render(tok, [SYSTEM, QUESTION, TOOL_TURN, TOOL_RESULT]))
        answers[name] = (one, two)

    assert close(url, "by-id", 1.0)["group"] == "open"
    assert close(url, "by-input", 0.0)["group"] == "buffered"
    built = take_one(redis_url, run_id)
    assert built.group_id == "resp-grp"
    prompt1 = render(tok, [SYSTEM, QUESTION])
    prompt2 = render(tok, [SYSTEM, QUESTION, TOOL_TURN, TOOL_RESULT])
    call_ids, ok_ids = ids(tok, CALL) + [EOS_ID], ids(tok, "ok") + [EOS_ID]
    glue = prompt2[len(prompt1) + len(call_ids) :]
    assert prompt2[: len(prompt1) + len(call_ids)] == prompt1 + call_ids  # the template extends exactly
    assert tok.decode(glue) == "\ntool: 5\nanswer: "
    assert built.prompt_tokens.tolist() == prompt1
    for sample, reward in zip(built.samples, (1.0, 0.0)):
        assert sample.completion_ids.tolist() == call_ids + glue + ok_ids
        assert sample.loss_mask.tolist() == [1] * len(call_ids) + [0] * len(glue) + [1] * len(ok_ids)
        assert sample.turn_starts == [0, len(call_ids) + len(glue)]
        assert sample.behavior_logprobs[len(call_ids) : len(call_ids) + len(glue)].tolist() == [0.0] * len(
            glue
        )
        assert (sample.reward, sample.text, len(sample.prompt_ids)) == (reward, "ok", 0)
    assert metric(url, "asyncrl_rollout_gateway_responses_total", event="continued") >= 1


def test_text_streaming_chat_and_refusals(url, tok, redis_url, run_id):
    """Without tools the answer is text (the model's call text, unparsed); streamed, it is the
    same response as events; chat completions on the same prompt give the same text."""
    client = client_of(f"{url}/v1")
    asked = {"model": "tiny", "input": [{"role": "developer", "content": "you add"},
                                        {"role": "user", "content": [{"type": "input_text", "text": "add two and three"}]}],
             "temperature": 0.0, "max_output_tokens": 80}  # fmt: skip
    sid = httpx.post(f"{url}/v1/sessions", json={"group_size": 1}, timeout=30).json()["session_id"]
    plain = client.responses.create(**asked, extra_headers={"X-AsyncRL-Session": sid})
    assert plain.output_text == CALL and plain.output[0].content[0].annotations == []
    chat = client.chat.completions.create(
        model="tiny", messages=[SYSTEM, QUESTION], temperature=0.0, max_tokens=80
    )
    assert chat.choices[0].message.content == plain.output_text  # developer is system, parts joined

    events = list(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[4].delta == CALL and events[-1].response.output_text == CALL
    assert events[0].response.status == "in_progress" and events[-1].response.status == "completed"

    close(url, sid, 0.5)
    [sample] = take_one(redis_url, run_id).samples
    assert sample.completion_ids.tolist() == ids(tok, CALL) + [EOS_ID] and sample.text == CALL
    assert sample.loss_mask.tolist() == [1] * (len(ids(tok, CALL)) + 1)

    cut = client.responses.create(model="tiny", input="add two", temperature=0.0, max_output_tokens=4)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == (
        "incomplete",
        "max_output_tokens",
        4,
    )
    assert cut.output_text == CALL[:4]

    refusals = [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            "input.0",
        ),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "call_id"),
    ]
    for change, named in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**{"model": "tiny", "input": "hi", **change})
        assert named in refused.value.message, refused.value.message
    # tool_choice reaches the chat path, which forces it (a prefilled hermes call with its name).
    forced = client.responses.create(
        model="tiny", input="hi", tools=[ADD_TOOL], tool_choice="required", max_output_tokens=32
    )
    assert [(o.type, o.name) for o in forced.output if o.type == "function_call"] == [
        ("function_call", "add")
    ]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nosuch")
    assert "resp_nosuch" in unknown.value.message and unknown.value.code == "unknown_response"
    unstored = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi", previous_response_id=unstored.id)
    assert (
        metric(url, "asyncrl_rollout_gateway_errors_total", route="responses", reason="unknown_response") == 2
    )


# --------------------------------------------------------------------------- openai-agents

AGENT_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def add(a: int, b: int) -> int:
        '''add two numbers'''
        ran.append((a, b))
        return a + b

    async def main(base_url, streamed):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        agent = Agent(name="adder", instructions="you add", tools=[add],
                      model=OpenAIResponsesModel(model="tiny", openai_client=client),
                      model_settings=ModelSettings(temperature=0.0, max_tokens=80))
        if streamed:
            result = Runner.run_streamed(agent, "add two and three")
            kinds = [event.data.type async for event in result.stream_events() if event.type == "raw_response_event"]
        else:
            result, kinds = await Runner.run(agent, "add two and three"), []
        outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
        print(json.dumps({"final": result.final_output, "ran": ran, "outputs": outputs, "kinds": kinds}))

    asyncio.run(main(sys.argv[1], sys.argv[2] == "streamed"))
    """
)


# `make test-extended` (.ci/run's second stage): builds openai-agents' venv
@pytest.mark.extended
def test_an_openai_agents_agent_calls_its_tool_through_the_gateway(url, tok, redis_url, run_id, tmp_path):
    python = thirdparty_venv("openai-agents", ["openai-agents==0.24.0"])
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    runs = {}
    for sid, mode in (("agent-plain", "plain"), ("agent-streamed", "streamed")):
        done = subprocess.run([str(python), str(script), f"{url}/v1/sessions/{sid}/v1", mode], capture_output=True,
                              text=True, timeout=300, env={"OPENAI_AGENTS_DISABLE_TRACING": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs[sid] = json.loads(done.stdout.strip().splitlines()[-1])
    for run in runs.values():
        # the tool ran with the model's arguments and its result went back to the model
        assert (run["ran"], run["outputs"], run["final"]) == ([[2, 3]], [5], "ok"), run
    kinds = runs["agent-streamed"]["kinds"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" in kinds

    prompt1 = render(tok, [SYSTEM, QUESTION])
    call_ids, ok_ids = ids(tok, CALL) + [EOS_ID], ids(tok, "ok") + [EOS_ID]
    glue = render(tok, [SYSTEM, QUESTION, TOOL_TURN, TOOL_RESULT])[len(prompt1) + len(call_ids) :]
    for sid, reward in (("agent-plain", 1.0), ("agent-streamed", 0.25)):
        assert close(url, sid, reward)["group"] == "buffered"
        built = take_one(redis_url, run_id)
        [sample] = built.samples
        assert built.group_id == sid and built.prompt_tokens.tolist() == prompt1
        assert tok.decode(glue) == "\ntool: 5\nanswer: "  # the tool's output, masked
        assert sample.completion_ids.tolist() == call_ids + glue + ok_ids
        assert sample.loss_mask.tolist() == [1] * len(call_ids) + [0] * len(glue) + [1] * len(ok_ids)
        assert sample.turn_starts == [0, len(call_ids) + len(glue)] and sample.reward == reward
