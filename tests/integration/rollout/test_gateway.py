"""The OpenAI-compatible gateway end to end on loopback: real Redis (fixture), the reference
engine (uvicorn thread, tiny Qwen2), the real reward service (subprocess), the rollout service
over HTTP, and the real `openai` client as the agent's. Nothing is mocked.

The tiny model's own chat template writes no end-of-turn token after an assistant message, so a
completion that stops at EOS is never a prefix of the next prompt. The agents below use the
tiny tokenizer with a template that does (`<eos>` after each assistant message, as Qwen's
`<|im_end|>`), and a second one that drops earlier assistant turns (as reasoning models'
templates drop earlier reasoning), which must split a session.

Also: the pure parts (a session's calls as pieces, hermes tool calls) on hand-made tokens.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from rollout_server import serve_in_thread, start_reward_service

from asyncrl.buffer import AdmissionControl, Buffer, ClosedSession, Groups, PolicyVersions
from asyncrl.proto import FinishReason, RewardStatus
from asyncrl.proto.gateway import Call
from asyncrl.services.ops.tinymodel import EOS_ID, build_tiny_model
from asyncrl.services.rollout.gateway.chat import _tool_calls
from asyncrl.services.rollout.gateway.samples import build_group, sessions_to_pieces
from asyncrl.services.transport.weights import parse_weight_version

torch.set_num_threads(1)

CONTEXT = 256
CAP = 64
# <eos> after each assistant message: a reply that stopped at EOS is a prefix of the next prompt.
# (Newlines as `{{ '\n' }}`: chat templates render with trim_blocks, which eats one after a tag.)
AGENT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Assistant messages before the last user message are left out (history rewritten).
DROPPING_TEMPLATE = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.index0 > ns.last %}{{ m['role'] }}: "
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gateway_model")
    build_tiny_model(path, seed=0, max_position_embeddings=CONTEXT)
    return str(path)


def tokenizer_with(model_dir: str, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def agent_tokenizer(model_dir):
    return tokenizer_with(model_dir, AGENT_TEMPLATE)


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
def start(redis_url, run_id, engine, reward, model_dir):
    """`start(tokenizer, **settings)`: a rollout service (a `RunningRollout`: `.url`, `.service`)
    on this test's run (B = 64, η = 0 unless `batch_groups` says otherwise), stopped at the end
    of the test."""
    running = []

    def start(tokenizer, batch_groups: int = 64, **extra):
        AdmissionControl(Buffer(redis_url, run_id)).configure(batch_groups=batch_groups, max_staleness=0)
        fields = {"run": run_id, "replica": "g0", "engine_urls": engine.url, "reward_url": reward.url,
                  "tokenizer": model_dir, "max_new_tokens_cap": CAP, "default_max_new_tokens": 8, "weights_poll_s": 0.5,
                  "engine_backoff_s": 0.05, **extra}  # fmt: skip
        running.append(serve_in_thread(redis_url, loaded_tokenizer=tokenizer, **fields))
        return running[-1]

    yield start
    for r in running:
        r.stop()


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def open_session(url: str, **body) -> dict:
    resp = httpx.post(f"{url}/v1/sessions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def close(url: str, sid: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions/{sid}/reward", json=body, timeout=30)


def take(redis_url: str, run_id: str, n: int) -> list:
    buf = Buffer(redis_url, run_id)
    return Groups(buf, "test-trainer").take(n, current_version=PolicyVersions(buf).version(), max_staleness=10**6,
                                            block_ms=2000).groups  # fmt: skip


def group_state(redis_url: str, run_id: str, gid: str) -> str | None:
    buf = Buffer(redis_url, run_id)
    state = buf.redis.hget(buf.keys.group_state, gid)
    return state.decode() if state else None


def render(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def completion_ids(tok, answer) -> list[int]:
    """The completion's token ids, read back from the answer's `logprobs.content` (one token
    string each; the tiny tokenizer has one id per character and per special token)."""
    ids = []
    for item in answer.choices[0].logprobs.content:
        [one] = tok(item.token, add_special_tokens=False)["input_ids"]
        ids.append(one)
    return ids


def engine_version(engine) -> int:
    info = httpx.get(f"{engine.url}/get_model_info", timeout=10).json()
    return parse_weight_version(info["weight_version"])[0]


def metric(url: str, name: str, **labels) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --------------------------------------------------------------------------- an agent's session


def test_agent_loop_through_the_openai_client_is_one_sample(
    start, agent_tokenizer, engine, redis_url, run_id
):
    tok = agent_tokenizer
    url = start(tok).url
    client = client_of(url)
    session = open_session(url, group_size=1, prompt_id="task-7")
    sid, gid = session["session_id"], session["group_id"]
    assert session["index"] == 0

    messages = [{"role": "system", "content": "reverse"}, {"role": "user", "content": "abc>"}]
    follow_ups = [
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "again>"},
    ]
    prompts, completions, logprobs, answers = [], [], [], []
    for turn in range(3):
        prompts.append(render(tok, messages))
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0,
                                                seed=11 + turn, logprobs=True, extra_headers={"X-AsyncRL-Session": sid})  # fmt: skip
        answers.append(answer)
        ids = completion_ids(tok, answer)
        completions.append(ids)
        logprobs.append([item.logprob for item in answer.choices[0].logprobs.content])
        # what the check below relies on: no special token inside the reply, which the text loses
        assert all(t > EOS_ID for t in ids[:-1]) and ids, ids
        assert answer.usage.prompt_tokens == len(prompts[-1]) and answer.usage.completion_tokens == len(ids)
        assert answer.choices[0].finish_reason == ("stop" if ids[-1] == EOS_ID else "length")
        assert answer.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        if turn < 2:
            messages.append(follow_ups[turn])

    resp = close(url, sid, reward=0.5)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"session_id": sid, "group_id": gid, "reward": 0.5, "reward_status": "scored",
                           "group": "buffered"}  # fmt: skip

    [group] = take(redis_url, run_id, 1)
    assert (group.group_id, group.job_id, group.reward_spec) == (gid, "gateway", {})
    assert group.prompt_tokens.tolist() == prompts[0]
    version = engine_version(engine)
    assert (group.submit_version, group.min_version) == (0, version)
    [sample] = group.samples
    # The template made each prompt the previous prompt + reply + new turn: one sample, whose
    # completion is reply 1, glue 1, reply 2, glue 2, reply 3.
    glues = []
    for i in (1, 2):
        context = prompts[i - 1] + completions[i - 1]
        assert prompts[i][: len(context)] == context
        glues.append(prompts[i][len(context) :])
    ended = ["" if c[-1] == EOS_ID else "<eos>" for c in completions]  # the template closes the turn
    assert tok.decode(glues[0], skip_special_tokens=False) == ended[0] + "\ntool: 42\nassistant: "
    assert tok.decode(glues[1], skip_special_tokens=False) == ended[1] + "\nuser: again>\nassistant: "
    c1, c2, c3 = completions
    g1, g2 = glues
    assert sample.completion_ids.tolist() == c1 + g1 + c2 + g2 + c3
    assert sample.loss_mask.tolist() == [1] * len(c1) + [0] * len(g1) + [1] * len(c2) + [0] * len(g2) + [
        1
    ] * len(c3)
    expected_lp = logprobs[0] + [0.0] * len(g1) + logprobs[1] + [0.0] * len(g2) + logprobs[2]
    assert np.array_equal(sample.behavior_logprobs, np.asarray(expected_lp, dtype=np.float32))
    assert sample.versions.tolist() == [version] * len(expected_lp)
    assert sample.turn_starts == [0, len(c1) + len(g1), len(c1) + len(g1) + len(c2) + len(g2)]
    assert len(sample.prompt_ids) == 0 and sample.episode is None
    assert (sample.prompt_id, sample.reward, sample.reward_status) == ("task-7", 0.5, RewardStatus.scored)
    assert sample.finish_reason is FinishReason(answers[2].choices[0].finish_reason)
    assert sample.text == answers[2].choices[0].message.content

    # The session is closed: another call, or another close, is a conflict.
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_headers={"X-AsyncRL-Session": sid}
        )
    second = close(url, sid, reward=1.0)
    assert second.status_code == 409 and "closed" in second.json()["error"]["message"]


def test_streaming_gives_the_text_of_the_same_call_unstreamed(start, agent_tokenizer):
    client = client_of(start(agent_tokenizer).url)
    messages = [{"role": "user", "content": "hello>"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, seed=5, temperature=1.0
    )
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=5, temperature=1.0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].message.content and len(text) > 0
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_a_template_that_rewrites_history_splits_the_session(start, model_dir, redis_url, run_id, engine):
    tok = tokenizer_with(model_dir, DROPPING_TEMPLATE)
    url = start(tok).url
    client = client_of(url)
    splits_before = metric(url, "asyncrl_rollout_gateway_sessions_total", event="split")
    session = open_session(url, group_size=1)
    sid = session["session_id"]
    messages = [{"role": "user", "content": "abc>"}]
    prompts, completions = [], []
    for turn in range(2):
        prompts.append(render(tok, messages))
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=21 + turn,
                                                logprobs=True, extra_body={"session_id": sid})  # fmt: skip
        completions.append(completion_ids(tok, answer))
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "more>"}]  # fmt: skip
    # the second prompt dropped the first reply: "user: abc>\nuser: more>\nassistant: "
    assert tok.decode(prompts[1]) == "user: abc>\nuser: more>\nassistant: "
    assert prompts[1][: len(prompts[0])] != prompts[0]
    resp = close(url, sid, reward=1.0)
    assert resp.status_code == 200 and resp.json()["group"] == "buffered", resp.text

    [group] = take(redis_url, run_id, 1)
    first, second = group.samples
    assert group.prompt_tokens.tolist() == prompts[0]
    assert (len(first.prompt_ids), first.episode) == (0, 0)  # the group's prompt; the episode's first piece
    assert (second.prompt_ids.tolist(), second.episode) == (prompts[1], 0)
    assert (
        first.completion_ids.tolist() == completions[0] and second.completion_ids.tolist() == completions[1]
    )
    assert first.loss_mask.tolist() == [1] * len(completions[0]) and first.turn_starts == [0]
    assert second.loss_mask.tolist() == [1] * len(completions[1]) and second.turn_starts == [0]
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert [s.reward_status for s in group.samples] == [RewardStatus.scored] * 2
    assert group.min_version == engine_version(engine)
    assert metric(url, "asyncrl_rollout_gateway_sessions_total", event="split") == splits_before + 1


# --------------------------------------------------------------------------- groups, refusals


def test_a_group_is_put_only_when_all_its_sessions_are_closed(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer).url
    client = client_of(url)
    a = open_session(url, group_id="grp-1", group_size=2, prompt_id="p")
    b = open_session(url, group_id="grp-1", group_size=2)
    assert (a["index"], b["index"], a["group_id"], b["group_id"]) == (0, 1, "grp-1", "grp-1")
    third = httpx.post(f"{url}/v1/sessions", json={"group_id": "grp-1", "group_size": 2})
    assert third.status_code == 409 and "already" in third.json()["error"]["message"]
    other_size = httpx.post(f"{url}/v1/sessions", json={"group_id": "grp-1", "group_size": 3})
    assert other_size.status_code == 409 and "group_size 2" in other_size.json()["error"]["message"]

    texts = {}
    for s, word in ((a, "ab>"), (b, "cd>")):
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": word}],
                                                max_tokens=4, seed=3, extra_headers={"X-AsyncRL-Session": s["session_id"]})  # fmt: skip
        texts[s["session_id"]] = answer.choices[0].message.content
    first = close(url, b["session_id"], reward=0.0)
    assert first.status_code == 200 and first.json()["group"] == "open"
    assert group_state(redis_url, run_id, "grp-1") is None  # not in the buffer yet
    second = close(url, a["session_id"], reward=1.0)
    assert second.status_code == 200 and second.json()["group"] == "buffered"
    assert group_state(redis_url, run_id, "grp-1") == "buffered"

    [group] = take(redis_url, run_id, 1)
    # samples in session order (a, then b), each with its own prompt and reward
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert [s.text for s in group.samples] == [texts[a["session_id"]], texts[b["session_id"]]]
    assert [s.prompt_id for s in group.samples] == ["p", "p"]
    assert group.prompt_tokens.tolist() == render(agent_tokenizer, [{"role": "user", "content": "ab>"}])
    assert group.samples[1].prompt_ids.tolist() == render(
        agent_tokenizer, [{"role": "user", "content": "cd>"}]
    )
    # a new session in a group that is in the buffer is refused
    late = httpx.post(f"{url}/v1/sessions", json={"group_id": "grp-1", "group_size": 2})
    assert late.status_code == 409
    assert metric(url, "asyncrl_rollout_gateway_groups_total", result="put") >= 1


def test_refusals_are_openai_errors(start, agent_tokenizer):
    url = start(agent_tokenizer).url
    client = client_of(url)
    hello = [{"role": "user", "content": "hi>"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model="tiny", messages=hello, extra_headers={"X-AsyncRL-Session": "snosuchsession"}
        )
    assert "no session" in unknown.value.message
    assert close(url, "snosuchsession", reward=1.0).status_code == 404

    with pytest.raises(openai.BadRequestError) as n2:
        client.chat.completions.create(model="tiny", messages=hello, n=2)
    assert "n" in n2.value.message
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model="tiny", messages=hello, logit_bias={"5": 1.0})
    assert "logit_bias" in unsupported.value.message
    with pytest.raises(openai.BadRequestError) as not_offered:
        client.chat.completions.create(model="tiny", messages=hello, tools=[{"type": "function", "function": {"name": "calc"}}],
                                       tool_choice={"type": "function", "function": {"name": "search"}})  # fmt: skip
    assert "'search'" in not_offered.value.message and not_offered.value.param == "tool_choice"
    too_long = [{"role": "user", "content": "a" * CONTEXT}]
    with pytest.raises(openai.BadRequestError) as context:
        client.chat.completions.create(model="tiny", messages=too_long)
    assert "context length" in context.value.message

    for body in (
        b"{not json",
        b'{"messages": []}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": [{"role": "narrator", "content": "hi"}]}',  # OpenAI's five roles only
    ):
        resp = httpx.post(
            f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    bad_session = httpx.post(f"{url}/v1/sessions", json={"group_size": 0})
    assert bad_session.status_code == 400 and "group_size" in bad_session.json()["error"]["message"]
    unknown_verifier = httpx.post(f"{url}/v1/sessions", json={"reward_spec": {"verifier": "nope"}})
    assert (
        unknown_verifier.status_code == 400
        and "unknown verifier" in unknown_verifier.json()["error"]["message"]
    )

    # a session without calls cannot be closed; a non-finite reward is not a reward
    sid = open_session(url)["session_id"]
    empty = close(url, sid, reward=1.0)
    assert empty.status_code == 400 and "no chat call" in empty.json()["error"]["message"]
    nan = httpx.post(f"{url}/v1/sessions/{sid}/reward", content=b'{"reward": NaN}',
                     headers={"content-type": "application/json"})  # fmt: skip
    assert nan.status_code == 400
    assert metric(url, "asyncrl_rollout_gateway_errors_total", route="chat", reason="unknown_session") >= 1
    assert metric(url, "asyncrl_rollout_gateway_requests_total", route="reward", code="400") >= 2


def test_an_engine_that_fails_is_a_502_then_none_healthy_a_503(start, agent_tokenizer):
    url = start(agent_tokenizer, engine_urls="http://127.0.0.1:9", engine_retries=0, engine_unhealthy_after=1,
                engine_probe_s=60, gateway_engine_wait_s=0.3).url  # fmt: skip
    client = client_of(url)
    hello = [{"role": "user", "content": "hi>"}]
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
    assert failed.value.status_code == 502 and failed.value.body["code"] == "engine_failure"
    with pytest.raises(openai.InternalServerError) as none:  # marked unhealthy after one failure
        client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
    assert none.value.status_code == 503 and none.value.body["code"] == "no_engine"
    assert metric(url, "asyncrl_rollout_gateway_requests_total", route="chat", code="502") == 1


def test_reward_spec_scores_the_last_answer(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer).url
    session = open_session(url, reward_spec={"verifier": "reverse", "target": "cba"})
    answer = client_of(url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "abc>"}],
        max_tokens=5,
        seed=1,
        extra_body={"session_id": session["session_id"]},
    )
    text = answer.choices[0].message.content
    resp = close(url, session["session_id"])
    assert resp.status_code == 200, resp.text
    matched = sum(x == y for x, y in zip(text, "cba"))
    expected = matched / max(3, len(text))  # the reverse verifier's rule, written out
    assert resp.json()["reward"] == pytest.approx(expected) and resp.json()["reward_status"] == "scored"
    [group] = take(redis_url, run_id, 1)
    assert group.reward_spec == {"verifier": "reverse", "target": "cba"}
    assert group.samples[0].reward == pytest.approx(expected)


def test_idle_groups_expire_and_give_their_admission_slot_back(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer, batch_groups=1, gateway_session_ttl_s=1.0, gateway_reap_interval_s=0.2).url
    buf = Buffer(redis_url, run_id)
    first = open_session(url)
    assert buf.redis.hexists(buf.keys.running, first["group_id"])  # the group holds the one slot
    full = httpx.post(f"{url}/v1/sessions", json={})
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "admission_full"
    deadline = time.monotonic() + 15
    while buf.redis.hexists(buf.keys.running, first["group_id"]):
        assert time.monotonic() < deadline, "the idle group never expired"
        time.sleep(0.1)
    assert close(url, first["session_id"], reward=1.0).status_code == 404  # expired: gone
    assert open_session(url)["index"] == 0  # the slot is free again
    assert metric(url, "asyncrl_rollout_gateway_sessions_total", event="expired") >= 1


def test_any_replica_serves_a_session_and_a_dead_putter_loses_nothing(
    start, agent_tokenizer, redis_url, run_id
):
    a = start(agent_tokenizer, replica="a", gateway_put_lease_s=0.5, gateway_reap_interval_s=0.2)
    b = start(agent_tokenizer, replica="b", gateway_put_lease_s=0.5, gateway_reap_interval_s=0.2)
    session = open_session(a.url, group_size=1)
    sid, gid = session["session_id"], session["group_id"]
    answer = client_of(b.url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "xy>"}],
                                                      max_tokens=4, seed=2, extra_headers={"X-AsyncRL-Session": sid})  # fmt: skip
    # Replica a closes the group's last session and dies before it puts the group: its close is
    # done in Redis (the store's own call), the put never happens there.
    answer_a = a.service.gateway.store.close(sid, {"reward": 0.25, "status": "scored"})
    assert answer_a == ["complete", gid]
    a.stop()
    deadline = time.monotonic() + 15
    while group_state(redis_url, run_id, gid) != "buffered":  # a reaper (b's) puts it after the lease
        assert time.monotonic() < deadline, "the complete group was never put"
        time.sleep(0.1)
    [group] = take(redis_url, run_id, 1)
    assert group.samples[0].text == answer.choices[0].message.content and group.samples[0].reward == 0.25
    assert close(b.url, sid, reward=1.0).status_code == 409  # closed (and put) already


# --------------------------------------------------------------------------- the pure parts


def call(prompt, tokens, logprobs, versions, finish="stop", text="", t=0.0) -> Call:
    return Call.of(prompt, tokens, logprobs, versions, lineage={0: max(versions)}, finish_reason=FinishReason(finish),
                   text=text, started=t, finished=t + 1)  # fmt: skip


def test_calls_become_pieces_by_hand():
    calls = [
        call([1, 2], [3, 4], [-0.5, -0.25], [4, 4], text="a"),
        call([1, 2, 3, 4, 5, 6], [7], [-1.0], [5], text="b"),  # extends: glue 5, 6
        call([1, 2, 9], [8], [-2.0], [5], finish="length", text="c"),  # does not: a new piece
    ]
    first, second = sessions_to_pieces(calls)
    assert first.prompt == [1, 2] and first.completion == [3, 4, 5, 6, 7]
    assert first.mask == [1, 1, 0, 0, 1]
    assert first.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert first.versions == [4, 4, 4, 4, 5]  # the glue carries the version of the token before it
    assert first.turn_starts == [0, 4] and first.text == "b"
    assert (second.prompt, second.completion, second.mask, second.turn_starts) == ([1, 2, 9], [8], [1], [0])

    other = [call([1, 2], [10, 11], [-0.1, -0.1], [5, 5])]  # a second session, same prompt
    group, splits = build_group("g", {"prompt_id": "p", "spec": "", "submit_version": "3"}, [
        ClosedSession(index=1, calls=other, result={"reward": 0.0, "status": "scored"}, closed_at=9.0),
        ClosedSession(index=0, calls=calls, result={"reward": 1.0, "status": "scored"}, closed_at=8.0),
    ])  # fmt: skip
    assert splits == 1
    assert group.prompt_tokens.tolist() == [1, 2]
    assert [s.episode for s in group.samples] == [0, 0, None]
    assert [s.prompt_ids.tolist() for s in group.samples] == [[], [1, 2, 9], []]
    assert [s.reward for s in group.samples] == [1.0, 1.0, 0.0]
    assert group.samples[1].finish_reason is FinishReason.length and group.samples[1].truncated
    assert (group.submit_version, group.min_version) == (3, 4)  # the oldest policy token


def test_hermes_tool_calls_become_openai_tool_calls():
    text = 'Let me add. <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    content, [tool] = _tool_calls(text)
    assert content == "Let me add."
    assert (tool.function.name, tool.function.arguments, tool.type) == ("calc", '{"x": 1}', "function")
    assert tool.id.startswith("call_")
    broken = "<tool_call>{oops}</tool_call>"
    assert _tool_calls(broken) == (broken, [])  # a block that does not parse stays text
    only, calls = _tool_calls(
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    assert only is None and [c.function.name for c in calls] == ["a", "b"]
    assert [c.function.arguments for c in calls] == ["{}", "{}"]


def test_a_session_named_in_the_base_url_is_created_on_first_use(start, agent_tokenizer, redis_url, run_id):
    """`base_url=.../v1/sessions/{id}/v1` alone records the calls; a foreign `X-Session-Id`
    (verifiers' trace id) is ignored; two sessions named into one group via the group headers
    make one group of two."""
    url = start(agent_tokenizer).url
    created = metric(url, "asyncrl_rollout_gateway_sessions_total", event="created_on_use")
    group = {"X-AsyncRL-Group": "url-grp", "X-AsyncRL-Group-Size": "2"}
    texts = {}
    for sid, word in (("agent-a", "ab>"), ("agent-b", "cd>")):
        client = openai.OpenAI(base_url=f"{url}/v1/sessions/{sid}/v1", api_key="x", max_retries=0,
                               timeout=60, default_headers={**group, "X-Session-Id": "trace-123"})  # fmt: skip
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": word}], max_tokens=4, seed=5
        )
        texts[sid] = answer.choices[0].message.content
    assert close(url, "agent-a", reward=1.0).json()["group"] == "open"
    assert close(url, "agent-b", reward=0.0).json()["group"] == "buffered"
    [built] = take(redis_url, run_id, 1)
    assert built.group_id == "url-grp"
    assert [s.text for s in built.samples] == [texts["agent-a"], texts["agent-b"]]
    assert [s.reward for s in built.samples] == [1.0, 0.0]
    assert metric(url, "asyncrl_rollout_gateway_sessions_total", event="created_on_use") == created + 2

    # no group header: a group of one named after the session
    solo = openai.OpenAI(base_url=f"{url}/v1/sessions/solo-1/v1", api_key="x", max_retries=0, timeout=60)
    solo.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x>"}], max_tokens=2)
    assert close(url, "solo-1", reward=0.5).json() | {"reward_status": None} == {
        "session_id": "solo-1", "group_id": "solo-1", "reward": 0.5, "reward_status": None, "group": "buffered"}  # fmt: skip

    # the old header names no session any more: the call is answered, not recorded
    plain = client_of(url)
    plain.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y>"}], max_tokens=2,
                                  extra_headers={"X-Session-Id": "solo-2"})  # fmt: skip
    assert close(url, "solo-2", reward=0.5).status_code == 404
    # URL and header naming different sessions; a bad group size
    with pytest.raises(openai.BadRequestError) as mismatch:
        solo.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x>"}],
                                     extra_headers={"X-AsyncRL-Session": "other"})  # fmt: skip
    assert mismatch.value.code == "session_mismatch"
    bad = openai.OpenAI(base_url=f"{url}/v1/sessions/s-new/v1", api_key="x", max_retries=0,
                        default_headers={"X-AsyncRL-Group-Size": "zero"})  # fmt: skip
    with pytest.raises(openai.BadRequestError) as size:
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x>"}])
    assert "X-AsyncRL-Group-Size" in size.value.message
