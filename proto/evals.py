"""HTTP bodies of evaluations (`POST/GET /v1/evaluations`) and the stored form of an evaluation.

An evaluation generates one completion per prompt of a held-out set at one pinned weight
version (greedy unless its sampling params say otherwise), scores them and summarizes:

* `accuracy` = items whose reward status is `scored` and whose reward is ≥ `CORRECT_REWARD`,
  over all items. An item the reward service could not score (`timeout`, `error`,
  `invalid_input`) counts as wrong; `statuses` counts the items of each status, so such items
  are never a silent 0.
* `formatted` = items whose answer had the final-answer format their verifier requires (the
  verifier says so: `RewardResult.formatted`, e.g. strict math's marked answer).
  `format_rate` = `formatted` over the items that needed a format: all items but the scored
  ones whose verifier has no notion of format (an unscored item counts as unformatted).
  `formatted_accuracy` = correct formatted items / `formatted` (null when none is formatted).
  All three are null when no item has a format verdict (verifiers without one: `reverse`,
  `code`, …). They tell learning from formatting: with strict math, accuracy = format_rate ×
  formatted_accuracy, so a gain in accuracy with a flat formatted_accuracy is a gain in format.
* `mean_reward` = mean reward of the `scored` items (null when none was scored).
* `mean_length` = mean completion length in tokens over all items.

Prompts take the shape of `proto.rollout.RolloutPrompt`. Stored values are JSON (never pickle).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import RewardSpec
from asyncrl.proto.rollout import RolloutPrompt
from asyncrl.proto.sglang import SamplingParams
from asyncrl.proto.states import JobState

CORRECT_REWARD = 1.0  # the toy and math verifiers give 1 for an exact answer; partial credit is not correct
MAX_EVAL_PROMPTS = 10_000
EVAL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # also a Prometheus label value

# An evaluation moves through a job's states (proto/states.py); it is never cancelled.
EvalState = Literal[JobState.queued, JobState.running, JobState.done, JobState.failed]


class EvalRequest(BaseModel):
    """Body of `POST /v1/evaluations`: evaluate `prompts` at the version the chosen engine serves
    when the evaluation starts."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("adhoc", pattern=EVAL_NAME_PATTERN, description="the evaluation set's name")
    prompts: list[RolloutPrompt] = Field(min_length=1, max_length=MAX_EVAL_PROMPTS)
    reward_spec: RewardSpec | None = Field(default=None, description="for prompts without their own")
    sampling_params: SamplingParams | None = Field(
        default=None,
        description="SGLang sampling params over the default: greedy (temperature 0), the service's "
        "eval_max_new_tokens",
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("sampling_params")
    @classmethod
    def _single_sample(cls, value: SamplingParams | None) -> SamplingParams | None:
        if value is not None and value.n != 1:
            raise ValueError("sampling_params.n must be 1: an evaluation takes one completion per prompt")
        return value

    @model_validator(mode="after")
    def _every_prompt_has_a_spec(self) -> EvalRequest:
        if self.reward_spec is None:
            missing = [i for i, p in enumerate(self.prompts) if p.reward_spec is None]
            if missing:
                raise ValueError(f"prompts {missing[:10]} have no reward_spec and the request gives none")
        return self


class EvalPrompt(BaseModel):
    """One tokenized prompt of a stored evaluation."""

    prompt_id: str
    prompt_tokens: list[int]
    prompt_text: str
    reward_spec: RewardSpec


class EvalTask(BaseModel):
    """What a runner needs, stored beside the summary: tokenized prompts and sampling params.
    `target_version` (automatic evaluations) is the only version the evaluation may run at."""

    prompts: list[EvalPrompt]
    sampling_params: dict[str, Any]
    target_version: int | None = None


class EvalItem(BaseModel):
    """The outcome of one prompt."""

    index: int
    prompt_id: str
    completion: str
    completion_tokens: int
    finish_reason: str = Field(description="stop | length (an aborted item fails the evaluation)")
    version: int = Field(description="the weight version every token of the completion carries")
    reward: float | None = Field(description="null unless reward_status is scored")
    reward_status: RewardStatus
    reward_details: dict[str, Any] = Field(default_factory=dict)
    formatted: bool | None = Field(
        None, description="the answer had the verifier's required format (null: no format verdict)"
    )


class EvalSummary(BaseModel):
    """An evaluation without its items (`GET /v1/evaluations` lists these)."""

    eval_id: str
    name: str
    source: Literal["api", "auto"]
    state: EvalState
    version: int | None = Field(None, description="the version the evaluation ran at (null while queued)")
    target_version: int | None = Field(None, description="automatic evaluations: the version they are for")
    prompts: int
    accuracy: float | None = None
    mean_reward: float | None = None
    mean_length: float | None = None
    correct: int | None = None
    scored: int | None = None
    formatted: int | None = Field(None, description="items whose answer had the required final-answer format")
    format_rate: float | None = Field(None, description="formatted / items that needed a format")
    formatted_accuracy: float | None = Field(
        None, description="correct formatted items / formatted (null when none is formatted)"
    )
    statuses: dict[str, int] = Field(default_factory=dict, description="items by reward status")
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    engine: str | None = None
    pinned: bool | None = Field(None, description="false when weights are broadcast (checked, not pinned)")
    replica: str | None = None
    attempts: int = 0
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = Field(None, description="why a failed evaluation failed")
    body_hash: str = ""


class EvalResult(EvalSummary):
    """Answer of `GET /v1/evaluations/{eval_id}`: the summary and, once done, every item."""

    items: list[EvalItem] = Field(default_factory=list)


class EvalAccepted(BaseModel):
    """Answer of `POST /v1/evaluations` (202)."""

    eval_id: str
    name: str
    state: EvalState
    duplicate: bool = Field(False, description="true when the idempotency key named an existing evaluation")


class EvalList(BaseModel):
    """Answer of `GET /v1/evaluations`: summaries ordered by version (queued ones last)."""

    evaluations: list[EvalSummary]
