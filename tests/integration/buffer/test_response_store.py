"""The gateway's stored responses in a real Redis: JSON round trip, the size bound, the TTL."""

from __future__ import annotations

import json

from asyncrl.buffer import Buffer
from asyncrl.buffer.responses import MAX_STORED_BYTES, ResponseStore
from asyncrl.buffer.sessions import KEY_TTL_FACTOR


def test_a_conversation_is_stored_as_json_bounded_and_expiring(redis_url, run_id):
    buf = Buffer(redis_url, run_id)
    store = ResponseStore(buf, ttl_s=30.0)
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]  # fmt: skip
    assert store.save("resp_a", messages) is True
    assert store.load("resp_a") == messages
    key = f"asyncrl:{{{run_id}}}:gw:response:resp_a"
    assert json.loads(buf.redis.get(key)) == {"messages": messages}  # plain JSON, nothing else
    assert 0 < buf.redis.pttl(key) <= 30_000 * KEY_TTL_FACTOR
    assert store.load("resp_unknown") is None

    big = [{"role": "user", "content": "x" * MAX_STORED_BYTES}]
    assert store.save("resp_big", big) is False
    assert store.load("resp_big") is None and not buf.redis.exists(key.replace("resp_a", "resp_big"))
