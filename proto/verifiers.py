"""The arguments of each built-in verifier's reward spec (the spec minus `verifier`), and their
one check: the reward service parses a spec with its verifier's model before scoring, the
rollout service checks the same model at submission, when the reward service publishes the
same JSON schema for it (`GET /v1/verifiers`). Limits that are a reward server's own settings
(the code verifier's `max_tests`, its largest `timeout_s`) are checked by that server only.

`INLINE` names the verifiers that are pure functions of (spec, prompt, completion): those a
rollout may score in its own process (`[rollout] local_verifiers`). It does so through a
`LocalScorer`, which the reward package provides under the `asyncrl.local_scorers` entry point,
so the rollout depends on this contract and not on the reward service's code.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from collections.abc import Collection
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncrl.proto.assert_split import Unsplittable, split_asserts
from asyncrl.proto.reasoning_gym import ReasoningGymSpec
from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import RewardItem, RewardSpec

MAX_TARGET_CHARS = 4096
INTEGER = re.compile(r"[+-]?\d{1,4000}")  # bounded so int() never sees a huge literal

# The entry-point group (and name) of the local scorer: a callable taking the inline verifiers'
# names and returning a `LocalScorer`.
LOCAL_SCORERS = "asyncrl.local_scorers"
LOCAL_SCORER = "inline"

MAX_SPEC_PROBLEMS = 5  # problems named per spec: a spec with 10k bad keys answers 5, not 10k
MAX_PROBLEM_CHARS = 200  # a loc or msg may quote the client (a dict key, a ValueError's text)


class SpecError(ValueError):
    """A spec that does not fit its verifier's schema or the server's limits (→ HTTP 422).

    `problems`: `(field, message)` pairs, each string cut to MAX_PROBLEM_CHARS, at most
    MAX_SPEC_PROBLEMS of them; the message joins them as `field: message; …`."""

    def __init__(self, problems: str | list[tuple[str, str]], total: int | None = None):
        if isinstance(problems, str):
            field, _, msg = problems.partition(": ")
            problems = [(field, msg)] if msg else [("spec", problems)]
        self.problems = [(_cut(f), _cut(m)) for f, m in problems[:MAX_SPEC_PROBLEMS]]
        total = len(problems) if total is None else total
        more = f" (and {total - len(self.problems)} more)" if total > len(self.problems) else ""
        super().__init__("; ".join(f"{f}: {m}" for f, m in self.problems) + more)


def _cut(text: object) -> str:
    return str(text)[:MAX_PROBLEM_CHARS]


def validate_spec(model: type[BaseModel], args: dict[str, Any]) -> BaseModel:
    """`args` (a reward spec minus `verifier`) as `model`, or `SpecError` naming each bad field.
    The one check of a spec's arguments: the reward service runs it before scoring, the rollout
    service at submission (`services/rollout/intake.py`)."""
    try:
        return model.model_validate(args)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        problems = [(".".join(map(str, e["loc"])) or "spec", e["msg"]) for e in errors[:MAX_SPEC_PROBLEMS]]
        raise SpecError(problems, total=len(errors)) from None


class ReverseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(
        None, min_length=1, max_length=MAX_TARGET_CHARS, description="the exact string to produce"
    )


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


class MathSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer: str = Field(min_length=1, max_length=10_000, description="gold answer (LaTeX or plain)")
    strict: bool | None = Field(
        None,
        description="pay only a marked final answer (last \\boxed{}, else <answer>…</answer>, else a "
        "last `#### x` or `Answer: x` line); null: the reward server's `math_strict`",
    )


class CodeTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stdin: str = Field("", max_length=10_000_000)
    stdout: str = Field(max_length=10_000_000)


class CodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    language: Literal["python"] = "python"
    tests: list[CodeTest] | None = Field(None, min_length=1, description="stdin/stdout tests")
    assert_code: str | None = Field(
        None, min_length=1, max_length=1_000_000, description="asserts run after the solution"
    )
    entry_point: str | None = Field(
        None, max_length=200, description="with assert_code: run `check(<entry_point>)` after it (HumanEval)"
    )
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per test (CPU limit: ceil of it)")
    memory_mb: int = Field(512, ge=64, description="address-space limit per test")
    partial: bool = Field(False, description="reward = passed fraction instead of all-or-nothing")
    strict: bool = Field(
        False,
        description="with assert_code: refuse asserts that cannot be split (judged outside the sandbox) "
        "instead of running them as written next to the program",
    )

    @model_validator(mode="after")
    def _one_mode(self) -> CodeSpec:
        if (self.tests is None) == (self.assert_code is None):
            raise ValueError("give exactly one of `tests` or `assert_code`")
        if self.entry_point is not None and self.assert_code is None:
            raise ValueError("entry_point needs assert_code")
        if self.strict and self.assert_code is not None:
            try:
                split_asserts(self.assert_code, self.entry_point)
            except Unsplittable as exc:
                raise ValueError(f"strict: assert_code cannot be split: {exc}") from None
        return self

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, name: str | None) -> str | None:
        if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
            raise ValueError("entry_point must be a Python identifier")
        return name


class JudgeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rubric: str = Field(min_length=1, max_length=50_000)
    reference: str | None = Field(None, max_length=200_000)
    scale: tuple[float, float] = Field((0.0, 10.0), description="[worst, best] score the judge may give")

    @model_validator(mode="after")
    def _scale(self) -> JudgeSpec:
        low, high = self.scale
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(
                f"scale must be two finite numbers [low, high] with low < high, got {list(self.scale)}"
            )
        return self


# A NeMo Gym resources server's name in `[reward.nemo_gym.<name>]`: a metric label and a spec's
# `server`, never a URL (the reward service calls only the servers its operator configured).
NEMO_GYM_SERVER_NAME = r"^[a-z][a-z0-9_-]{0,63}$"
NEMO_GYM_MAX_TASK_CHARS = 1_000_000  # a task row as JSON, seed_session and verify carry it twice
NEMO_GYM_RESERVED = frozenset({"responses_create_params", "response", "reward"})  # what we fill in


class NemoGymSpec(BaseModel):
    """A sample scored by a configured NeMo Gym resources server (`seed_session` → `verify` →
    optional close). `task` is the dataset row's own fields (NeMo Gym rows carry them next to
    `responses_create_params`: `expected_answer`, `initial_count`, …), sent in both bodies."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field(
        pattern=NEMO_GYM_SERVER_NAME, description="a server configured as [reward.nemo_gym.<name>]"
    )
    task: dict[str, Any] = Field(
        default_factory=dict, description="the task row's fields, sent with seed_session and verify"
    )
    responses_create_params: dict[str, Any] | None = Field(
        None, description="the row's Responses API request; default: the prompt as the one user input"
    )

    @model_validator(mode="after")
    def _bounded(self) -> NemoGymSpec:
        reserved = sorted(NEMO_GYM_RESERVED & set(self.task))
        if reserved:
            raise ValueError(f"task may not set {', '.join(reserved)}: the verifier fills them in")
        if self.responses_create_params is not None and "input" not in self.responses_create_params:
            raise ValueError("responses_create_params needs `input` (a Responses API request)")
        size = len(json.dumps([self.task, self.responses_create_params], default=str))
        if size > NEMO_GYM_MAX_TASK_CHARS:
            raise ValueError(
                f"task and responses_create_params are {size} chars as JSON, at most {NEMO_GYM_MAX_TASK_CHARS}"
            )
        return self


SPECS: dict[str, type[BaseModel]] = {
    "reverse": ReverseSpec,
    "arith": ArithSpec,
    "math": MathSpec,
    "code": CodeSpec,
    "judge": JudgeSpec,
    "nemo_gym": NemoGymSpec,
    "reasoning_gym": ReasoningGymSpec,
}
INLINE = frozenset({"reverse", "arith"})  # pure functions: scored at once, no slot, no budget


class LocalVerdict(Protocol):
    """What a local scorer answers per item (the reward service's `Verdict` has these)."""

    status: RewardStatus
    reward: float | None
    details: dict[str, Any]
    formatted: bool | None  # as `asyncrl.proto.rewards.RewardResult.formatted`


class LocalScorer(Protocol):
    """Inline verifiers judged in the caller's process, with the reward service's own checks and
    verdicts. An item whose spec the verifier refuses makes every item of that call
    `invalid_input`, as the service's 422 would."""

    verifiers: Collection[str]  # the names it scores

    def score(self, items: list[RewardItem]) -> list[LocalVerdict]:
        """One verdict per item, in order; every item's verifier is one of `verifiers`."""
        ...

    def score_group(self, spec: RewardSpec, prompt: str, completions: list[str]) -> list[LocalVerdict]:
        """`score` of completions of one prompt under one spec, without an item per completion."""
        ...
