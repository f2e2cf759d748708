"""The verifier interface: a typed spec, a concurrency limit, an item budget, and `verify`.

A verifier returns a `Verdict`. `scored` is the only status with a reward; a verifier that
could not judge says so (`timeout`, `error`, `invalid_input`) with a `reason` in `details`,
so nothing downstream mistakes an infrastructure failure for a wrong answer. A verifier that
requires a final-answer format says on each scored verdict whether the answer had it
(`formatted`), so a wrong answer and a missing one are told apart; the others leave it None.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from asyncrl.proto.records import RewardStatus, check_reward
from asyncrl.proto.rewards import check_formatted
from asyncrl.proto.verifiers import validate_spec


@dataclass
class Verdict:
    status: RewardStatus
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    formatted: bool | None = None  # the answer had the required final-answer format (scored only)

    def __post_init__(self) -> None:
        check_reward(self.reward, self.status)  # a NaN score is refused here, as an error of this item
        check_formatted(self.formatted, self.status)

    @classmethod
    def scored(cls, reward: float, *, formatted: bool | None = None, **details: Any) -> Verdict:
        return cls(RewardStatus.scored, float(reward), details, formatted)

    def cached(self) -> Verdict:
        """This verdict as served again from the cache (or an identical item in flight)."""
        return Verdict(self.status, self.reward, {**self.details, "cached": True}, self.formatted)

    @classmethod
    def failed(cls, status: RewardStatus, reason: str, **details: Any) -> Verdict:
        """A non-scored verdict; `reason` is a short bounded token (it becomes a metric label)."""
        return cls(status, None, {"reason": reason, **details})


class Verifier(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    Spec: ClassVar[type[BaseModel]]  # verifier arguments (the spec minus `verifier`), extra="forbid"
    # A pure function of its inputs (toy verifiers) implements `judge` instead of `verify`: it is
    # scored in the request's own task, without a slot, a budget or a task per item (nothing
    # could interrupt it before it returns anyway).
    inline: ClassVar[bool] = False

    def __init__(self, *, concurrency: int, timeout_s: float):
        self.concurrency = concurrency
        self.timeout_s = timeout_s

    def parse_spec(self, args: dict[str, Any]) -> BaseModel:
        """The spec's arguments as `Spec`; a subclass adds this server's limits (`SpecError`)."""
        return validate_spec(self.Spec, args)

    def item_timeout_s(self, spec: BaseModel) -> float:
        """Longest the scorer waits for one item once it holds a slot; past it the item is `timeout`."""
        return self.timeout_s

    def uses_prompt(self, spec: BaseModel) -> bool:
        """Whether the verdict depends on the prompt (then the prompt joins the cache key)."""
        return False

    async def start(self) -> None:  # noqa: B027 — optional: most verifiers hold nothing
        """Acquire processes or connections; called once before the first `verify`."""

    async def close(self) -> None:  # noqa: B027 — optional, as `start`
        """Release what `start` acquired."""

    def health(self) -> str:
        return "ok"

    async def verify(self, spec: BaseModel, prompt: str, completion: str) -> Verdict:
        """The verdict on one completion; an `inline` verifier's is `judge`'s."""
        if not self.inline:
            raise NotImplementedError(f"{type(self).__name__} implements neither verify nor judge")
        return self.judge(spec, prompt, completion)

    def judge(self, spec: BaseModel, prompt: str, completion: str) -> Verdict:
        """An `inline` verifier's verdict, computed at once (no I/O, no awaiting)."""
        raise NotImplementedError(f"{type(self).__name__} is not inline")
