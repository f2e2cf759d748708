"""Toy verifiers of the CPU demo: `reverse` (dense per-character reward) and `arith` (exact match).

Both are pure string functions, cheap enough to run on the event loop: `inline` verifiers.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.proto.records import RewardStatus
from asyncrl.services.reward.verifiers.base import Verdict, Verifier

MAX_TARGET_CHARS = 4096
INTEGER = re.compile(r"[+-]?\d{1,4000}")  # bounded so int() never sees a huge literal


def reverse_reward(target: str, completion: str) -> tuple[float, int]:
    """Fraction of target positions matched, over max(len(target), len(completion)).

    Dividing by the longer length makes extra or missing characters strictly worse than the
    exact answer: the exact answer scores 1 and nothing else does.
    """
    matched = sum(1 for got, want in zip(completion, target) if got == want)
    return matched / max(len(target), len(completion)), matched


def target_from_prompt(prompt: str) -> str:
    """The demo's rule when a spec has no `target`: the prompt text before its last `>`
    (the whole prompt if it has none), surrounding whitespace stripped, reversed."""
    head = prompt.rsplit(">", 1)[0] if ">" in prompt else prompt
    return head.strip()[::-1]


class ReverseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(
        None, min_length=1, max_length=MAX_TARGET_CHARS, description="the exact string to produce"
    )


class ReverseVerifier(Verifier):
    name = "reverse"
    description = (
        "Dense reward for producing `target` character by character: matches / max(len(target), "
        "len(completion)). Without `target`, the target is the prompt text before its last '>', "
        "stripped and reversed."
    )
    Spec = ReverseSpec
    inline = True

    def uses_prompt(self, spec: ReverseSpec) -> bool:
        return spec.target is None

    def judge(self, spec: ReverseSpec, prompt: str, completion: str) -> Verdict:
        target = spec.target if spec.target is not None else target_from_prompt(prompt)
        if not target:
            return Verdict.failed(
                RewardStatus.invalid_input, "empty_target", error="no target and none in the prompt"
            )
        if len(target) > MAX_TARGET_CHARS:
            return Verdict.failed(RewardStatus.invalid_input, "target_too_long", max_chars=MAX_TARGET_CHARS)
        reward, matched = reverse_reward(target, completion)
        return Verdict.scored(reward, matched=matched, target_len=len(target), completion_len=len(completion))


class ArithSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer: str = Field(description="the exact integer answer, as a string")
    format_credit: float = Field(
        0.0, ge=0.0, lt=1.0, description="reward for a well-formed but wrong integer answer"
    )

    @field_validator("answer", mode="before")
    @classmethod
    def _integer(cls, value: object) -> str:
        text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
        if text is None or not INTEGER.fullmatch(text):
            raise ValueError(f"answer must be an integer, got {value!r}")
        return text


class ArithVerifier(Verifier):
    name = "arith"
    description = (
        "Exact-match integer arithmetic: 1 if the stripped completion is the integer `answer`, "
        "`format_credit` if it is some other integer, 0 otherwise."
    )
    Spec = ArithSpec
    inline = True

    def judge(self, spec: ArithSpec, prompt: str, completion: str) -> Verdict:
        text = completion.strip()
        if not INTEGER.fullmatch(text):
            return Verdict.scored(0.0, well_formed=False)
        correct = int(text) == int(spec.answer)
        return Verdict.scored(1.0 if correct else spec.format_credit, well_formed=True, correct=correct)
