"""Bodies of the rollout service's OpenAI-compatible gateway (services/rollout/gateway/chat.py
says what it does), and the record of one chat call it keeps in Redis.

* `POST /v1/sessions`: `SessionRequest` → `SessionCreated`.
* `POST /v1/sessions/{id}/reward`: `SessionReward` → `SessionClosed`.
* `DELETE /v1/sessions/{id}`: → `SessionAbandoned` (the session's whole group is dropped).
* `POST /v1/chat/completions`: proto/openai.py's `GatewayChatRequest` → `ChatCompletion` (or its
  chunks, `sse_chunks` in services/rollout/gateway/chat.py); the gateway refuses a field that would change
  the output instead of ignoring it (its `check_request`).
* `Call`: one chat call of a session as sampled (token ids, behaviour logprobs, the policy
  version of every token), written by the replica that served it and read by whichever
  replica builds the group (buffer/sessions.py stores it).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.proto.records import FinishReason, RewardStatus
from asyncrl.proto.rewards import RewardSpec

ID_PATTERN = r"^[A-Za-z0-9._-]+$"  # group, prompt and session ids (they name Redis keys)


# --- sessions -------------------------------------------------------------------------------


class SessionRequest(BaseModel):
    """Body of `POST /v1/sessions`. Sessions with one `group_id` form one group of
    `group_size`; its `prompt_id` and `reward_spec` are its first session's (a later session
    naming others is refused)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=ID_PATTERN, description="default: a new group"
    )
    group_size: int = Field(1, ge=1, le=MAX_GROUP_SIZE)
    prompt_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=ID_PATTERN, description="default: the group id"
    )
    reward_spec: RewardSpec | None = Field(
        None, description="scores the session's last answer when it is closed without a reward"
    )


class SessionCreated(BaseModel):
    session_id: str
    group_id: str
    index: int = Field(description="position of the session in its group")


class SessionReward(BaseModel):
    """Body of `POST /v1/sessions/{id}/reward`: the session's reward, or nothing to have the
    session's `reward_spec` verifier score its last answer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float | None = None


class SessionClosed(BaseModel):
    session_id: str
    group_id: str
    reward: float | None
    reward_status: RewardStatus
    group: Literal["open", "buffered", "duplicate", "failed"] = Field(
        description="open: sessions of the group are still open; buffered: this close completed the group, now "
        "in the buffer; duplicate: it was put before; failed: it could not be built (logged, counted)"
    )


class SessionAbandoned(BaseModel):
    session_id: str
    group_id: str
    sessions_open: int = Field(
        description="sessions of the group still open when it was abandoned (0: again)"
    )
    again: bool = Field(
        description="the group had been abandoned before (a repeated DELETE, or a sibling's): nothing changed"
    )


# --- the record of a chat call ----------------------------------------------------------------


class Call(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat call of a session as stored in Redis (msgpack): token arrays as little-endian
    int32 / float32 bytes."""

    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes  # behaviour log μ of each completion token
    versions: bytes  # policy version of each completion token
    lineage: dict[int, int]  # epoch -> newest version that sampled a token of this call
    finish_reason: FinishReason
    text: str
    started: float
    finished: float

    @classmethod
    def of(
        cls, prompt: list[int], tokens: list[int], logprobs: list[float], versions: list[int], **fields
    ) -> Call:
        return cls(
            prompt_ids=np.asarray(prompt, "<i4").tobytes(),
            completion_ids=np.asarray(tokens, "<i4").tobytes(),
            logprobs=np.asarray(logprobs, "<f4").tobytes(),
            versions=np.asarray(versions, "<i4").tobytes(),
            **fields,
        )

    def arrays(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """(prompt ids, completion ids, logprobs, versions) as lists."""
        return (
            np.frombuffer(self.prompt_ids, "<i4").tolist(),
            np.frombuffer(self.completion_ids, "<i4").tolist(),
            np.frombuffer(self.logprobs, "<f4").tolist(),
            np.frombuffer(self.versions, "<i4").tolist(),
        )
