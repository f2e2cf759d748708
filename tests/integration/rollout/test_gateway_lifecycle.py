"""The gateway's session lifecycle and OpenAI conformance on loopback: abandoning a session
(`DELETE /v1/sessions/{id}`) fails its group whole and frees its admission slot at once,
sessions whose agent never called can be abandoned, admission holds for sessions created on
first use, `/v1/models`, and OpenAI's error shape for unknown paths and wrong methods.

Real Redis, the reference engine (tiny Qwen2), the real reward service, the rollout service over
HTTP and the real `openai` client; the fixtures are test_gateway.py's.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import test_gateway as gw
from test_gateway import client_of, close, group_state, metric, open_session, take

from asyncrl.buffer import Buffer

# test_gateway's fixtures, used here by name
agent_tokenizer, engine, model_dir, reward, start = (
    gw.agent_tokenizer,
    gw.engine,
    gw.model_dir,
    gw.reward,
    gw.start,
)
HELLO = [{"role": "user", "content": "hi>"}]


def abandon(url: str, sid: str) -> httpx.Response:
    return httpx.delete(f"{url}/v1/sessions/{sid}", timeout=30)


def holds_slot(redis_url: str, run_id: str, gid: str) -> bool:
    buf = Buffer(redis_url, run_id)
    return bool(buf.redis.hexists(buf.keys.running, gid))


def test_abandoning_a_session_fails_its_whole_group(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer).url
    client = client_of(url)
    abandoned_before = metric(url, "asyncrl_rollout_gateway_groups_total", result="abandoned")
    sessions_before = metric(url, "asyncrl_rollout_gateway_sessions_total", event="abandoned")
    a, b, c = (open_session(url, group_id="doomed", group_size=3) for _ in range(3))
    for s in (a, b):
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, seed=1,
                                       extra_headers={"X-AsyncRL-Session": s["session_id"]})  # fmt: skip
    assert close(url, b["session_id"], reward=1.0).json()["group"] == "open"
    assert holds_slot(redis_url, run_id, "doomed")

    # c's agent crashed before its first call: its client deletes it
    resp = abandon(url, c["session_id"])
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "session_id": c["session_id"],
        "group_id": "doomed",
        "sessions_open": 2,
        "again": False,
    }
    assert not holds_slot(redis_url, run_id, "doomed")  # at once, not after the TTL
    assert metric(url, "asyncrl_rollout_gateway_groups_total", result="abandoned") == abandoned_before + 1
    assert metric(url, "asyncrl_rollout_gateway_sessions_total", event="abandoned") == sessions_before + 2

    # the siblings' later calls and closes are refused, naming the abandonment
    with pytest.raises(openai.ConflictError) as call:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                       extra_headers={"X-AsyncRL-Session": a["session_id"]})  # fmt: skip
    assert call.value.code == "group_abandoned" and "abandoned" in call.value.message
    late_close = close(url, a["session_id"], reward=0.0)
    assert late_close.status_code == 409 and late_close.json()["error"]["code"] == "group_abandoned"
    joining = httpx.post(f"{url}/v1/sessions", json={"group_id": "doomed", "group_size": 3})
    assert joining.status_code == 409 and "abandoned" in joining.json()["error"]["message"]

    # idempotent: a second DELETE, or a sibling's, answers 200 `again`, and counts nothing more
    for sid in (c["session_id"], a["session_id"]):
        again = abandon(url, sid)
        assert again.status_code == 200
        assert again.json() == {"session_id": sid, "group_id": "doomed", "sessions_open": 0, "again": True}
    assert metric(url, "asyncrl_rollout_gateway_groups_total", result="abandoned") == abandoned_before + 1
    assert abandon(url, "snosuchsession").status_code == 404

    # nothing of the group ever reaches the buffer
    assert group_state(redis_url, run_id, "doomed") is None
    assert take(redis_url, run_id, 1) == []


def test_a_group_in_the_buffer_cannot_be_abandoned(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer).url
    s = open_session(url, group_id="kept")
    client_of(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                           extra_headers={"X-AsyncRL-Session": s["session_id"]})  # fmt: skip
    assert close(url, s["session_id"], reward=1.0).json()["group"] == "buffered"
    late = abandon(url, s["session_id"])
    assert late.status_code == 409 and late.json()["error"]["code"] == "group_complete"
    [group] = take(redis_url, run_id, 1)
    assert group.group_id == "kept" and group.samples[0].reward == 1.0


def test_empty_sessions_fill_the_window_until_they_are_deleted(start, agent_tokenizer, redis_url, run_id):
    """Agents that crash before their first call: their sessions hold the admission window
    (429 for a new one) until deleted; closing one with a reward is refused."""
    url = start(agent_tokenizer, batch_groups=2).url
    crashed = [open_session(url) for _ in range(2)]
    full = httpx.post(f"{url}/v1/sessions", json={})
    assert full.status_code == 429 and full.json()["error"]["code"] == "admission_full"
    refused = close(url, crashed[0]["session_id"], reward=1.0)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "empty_session"
    assert "DELETE" in refused.json()["error"]["message"]
    assert abandon(url, crashed[0]["session_id"]).json()["sessions_open"] == 1
    assert not holds_slot(redis_url, run_id, crashed[0]["group_id"])
    assert holds_slot(redis_url, run_id, crashed[1]["group_id"])
    admitted = open_session(url)
    assert admitted["index"] == 0 and holds_slot(redis_url, run_id, admitted["group_id"])


def test_sessions_created_on_first_use_are_admitted_as_any_group(start, agent_tokenizer, redis_url, run_id):
    url = start(agent_tokenizer, batch_groups=1).url
    crashed = open_session(url)  # holds the one slot
    agent = openai.OpenAI(base_url=f"{url}/v1/sessions/url-agent/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.RateLimitError) as full:
        agent.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    assert full.value.code == "admission_full"
    assert close(url, "url-agent", reward=1.0).status_code == 404  # refused: never created
    assert abandon(url, crashed["session_id"]).status_code == 200
    answer = agent.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, seed=4)
    assert holds_slot(redis_url, run_id, "url-agent")
    assert close(url, "url-agent", reward=0.5).json()["group"] == "buffered"
    [group] = take(redis_url, run_id, 1)
    assert group.group_id == "url-agent" and group.samples[0].text == answer.choices[0].message.content


def test_models_are_listed_in_openai_shape(start, agent_tokenizer, model_dir):
    url = start(agent_tokenizer).url
    name = model_dir.rstrip("/").rsplit("/", 1)[-1]
    listed = client_of(url).models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [(name, "model", "asyncrl")]
    raw = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert raw["object"] == "list" and raw["data"][0]["created"] == listed.data[0].created
    session_base = openai.OpenAI(base_url=f"{url}/v1/sessions/lister/v1", api_key="x", max_retries=0)
    assert [m.id for m in session_base.models.list().data] == [name]
    assert close(url, "lister", reward=1.0).status_code == 404  # listing creates no session


def test_unknown_paths_and_wrong_methods_under_v1_are_openai_errors(start, agent_tokenizer):
    url = start(agent_tokenizer).url
    before = metric(url, "asyncrl_rollout_gateway_errors_total", route="unmatched", reason="unknown_route")
    unknown = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert unknown.status_code == 404
    assert unknown.json() == {"error": {"message": "no route '/v1/completions'", "type": "not_found_error",
                                        "param": None, "code": "unknown_route"}}  # fmt: skip
    with pytest.raises(openai.NotFoundError) as embeddings:
        client_of(url).embeddings.create(model="tiny", input="x")
    assert embeddings.value.code == "unknown_route"
    assert (
        metric(url, "asyncrl_rollout_gateway_errors_total", route="unmatched", reason="unknown_route")
        == before + 2
    )

    wrong = httpx.get(f"{url}/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    error = wrong.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "method_not_allowed",
        None,
    )
    assert "GET is not allowed" in error["message"]
    assert httpx.put(f"{url}/v1/sessions/s1", timeout=10).json()["error"]["code"] == "method_not_allowed"

    # the other services' routes keep their own shapes
    outside = httpx.get(f"{url}/nowhere", timeout=10)
    assert outside.status_code == 404 and outside.json() == {"detail": "Not Found"}
    job = httpx.get(f"{url}/v1/rollouts/nojob", timeout=10)
    assert job.status_code == 404 and "error" not in job.json()
