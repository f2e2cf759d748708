"""HTTP bodies of the reward service (`POST /v1/rewards`), shared by rollout and reward.

`status` separates "infrastructure failed" (`timeout`, `error`) and "the input was bad"
(`invalid_input`) from "the answer was judged" (`scored`); only `scored` carries a reward.
`formatted` says whether a scored answer had the final-answer format its verifier requires
(math: a marked answer it could read; reasoning_gym: an answer tag), so "wrong" and "never
gave an answer" can be told apart; null where the verifier has no notion of format or did
not judge. Optional on the wire: a client that does not read it loses nothing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.proto.records import RewardStatus, check_reward

MAX_ITEMS_PER_BATCH = MAX_GROUP_SIZE  # a group's samples are scored in one batch
MAX_COMPLETION_CHARS = 1_000_000  # hard cap on the wire; verifiers cap lower before parsing


def check_formatted(formatted: bool | None, status: RewardStatus) -> None:
    """Only a judged answer has a format verdict: an item that was not scored has none."""
    if formatted is not None and status is not RewardStatus.scored:
        raise ValueError(f"formatted must be None when the status is {status.value}")


class RewardSpec(BaseModel):
    """`{"verifier": "math"|"code"|"judge"|"reverse"|"arith"|…, …verifier arguments}`.

    Checked where it enters: at the rollout's intake (with the verifier's published schema),
    which hands the records its `model_dump()` for the rollout to pass on as it is, and at the
    reward service's door, which outside clients call too."""

    model_config = ConfigDict(extra="allow")

    verifier: str = Field(min_length=1, max_length=64)

    def args(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RewardItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    prompt: str = Field(default="", max_length=MAX_COMPLETION_CHARS)
    completion: str = Field(max_length=MAX_COMPLETION_CHARS)
    spec: RewardSpec


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[RewardItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_BATCH)

    @model_validator(mode="after")
    def _unique_ids(self) -> RewardRequest:
        ids = [item.id for item in self.items]
        if len(set(ids)) != len(ids):
            raise ValueError("item ids must be unique within a batch")
        return self


class RewardResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    status: RewardStatus
    reward: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    formatted: bool | None = Field(
        None,
        description="the answer had the final-answer format the verifier requires (null: the verifier "
        "has no notion of format, or the item was not scored)",
    )

    @model_validator(mode="after")
    def _reward_iff_scored(self) -> RewardResult:
        check_reward(self.reward, self.status)
        check_formatted(self.formatted, self.status)
        return self


class RewardResponse(BaseModel):
    results: list[RewardResult]


class VerifierInfo(BaseModel):
    """One entry of `GET /v1/verifiers`: what a verifier does and the JSON schema of its spec
    arguments (the spec minus `verifier`)."""

    name: str
    description: str
    spec_schema: dict[str, Any]
    concurrency: int
    timeout_s: float


class VerifierList(BaseModel):
    verifiers: list[VerifierInfo]
