"""The verifier interface: a typed spec, a concurrency limit, an item budget, and `verify`.

A verifier returns a `Verdict`. `scored` is the only status with a reward; a verifier that
could not judge says so (`timeout`, `error`, `invalid_input`) with a `reason` in `details`,
so nothing downstream mistakes an infrastructure failure for a wrong answer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from proto.records import RewardStatus


@dataclass
class Verdict:
    status: RewardStatus
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def scored(cls, reward: float, **details: Any) -> Verdict:
        return cls(RewardStatus.scored, float(reward), details)

    @classmethod
    def failed(cls, status: RewardStatus, reason: str, **details: Any) -> Verdict:
        """A non-scored verdict; `reason` is a short bounded token (it becomes a metric label)."""
        assert status is not RewardStatus.scored
        return cls(status, None, {"reason": reason, **details})


class SpecError(ValueError):
    """A spec that does not fit its verifier's schema or the server's limits (→ HTTP 422)."""


class Verifier(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    Spec: ClassVar[type[BaseModel]]  # verifier arguments (the spec minus `verifier`), extra="forbid"

    def __init__(self, *, concurrency: int, timeout_s: float):
        self.concurrency = concurrency
        self.timeout_s = timeout_s

    def parse_spec(self, args: dict[str, Any]) -> BaseModel:
        try:
            return self.Spec.model_validate(args)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in exc.errors()
            )
            raise SpecError(problems) from None

    def item_timeout_s(self, spec: BaseModel) -> float:
        """Longest the scorer waits for one item once it holds a slot; past it the item is `timeout`."""
        return self.timeout_s

    def uses_prompt(self, spec: BaseModel) -> bool:
        """Whether the verdict depends on the prompt (then the prompt joins the cache key)."""
        return False

    async def start(self) -> None:
        """Acquire processes or connections; called once before the first `verify`."""

    async def close(self) -> None:
        """Release what `start` acquired."""

    def health(self) -> str:
        return "ok"

    @abc.abstractmethod
    async def verify(self, spec: BaseModel, prompt: str, completion: str) -> Verdict: ...
