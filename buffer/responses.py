"""The gateway's stored responses (services/rollout/gateway/responses.py): the conversation a
response ended, so that a later `POST /v1/responses` naming it in `previous_response_id`
continues from it.

| key | type | contents |
|---|---|---|
| `gw:response:<id>` | string | JSON: `{"messages": [...]}`, the conversation in chat-template form, the response's own answer last |

Each key expires with the sessions' keys (`gateway_session_ttl_s` × `KEY_TTL_FACTOR` after it
was written): a response outlives no session it could continue. A conversation over
`MAX_STORED_BYTES` is not stored (the caller counts it); JSON only, never pickle.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.buffer.connection import Buffer
from asyncrl.buffer.sessions import KEY_TTL_FACTOR

MAX_STORED_BYTES = 4 * 1024 * 1024  # one conversation; bounds what a client can park in Redis


class ResponseStore:
    """Stored conversations by response id; one round trip per call."""

    def __init__(self, buf: Buffer, ttl_s: float):
        self.redis = buf.redis
        self.prefix = buf.keys.prefix + "gw:response:"
        self.ttl_ms = int(ttl_s * KEY_TTL_FACTOR * 1000)

    def save(self, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Store the conversation; False (nothing written) when it is over `MAX_STORED_BYTES`."""
        blob = json.dumps({"messages": messages}, ensure_ascii=False).encode("utf-8")
        if len(blob) > MAX_STORED_BYTES:
            return False
        self.redis.set(self.prefix + response_id, blob, px=self.ttl_ms)
        return True

    def load(self, response_id: str) -> list[dict[str, Any]] | None:
        """The stored conversation, None when unknown, expired or never stored."""
        blob = self.redis.get(self.prefix + response_id)
        return None if blob is None else json.loads(blob)["messages"]
