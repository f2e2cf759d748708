"""The reward service's scoring of inline verifiers, for another process to run in its own
(`proto.verifiers.LocalScorer`; the rollout's `[rollout] local_verifiers`). Registered under
the `asyncrl.local_scorers` entry point (pyproject.toml), so the caller loads it without
importing this package by name.

The spec checks, verdicts and counters are the service's own (`scoring.Scorer`), without a
result cache: a cache key costs more than these verdicts. A call whose spec the verifier
refuses makes every item of that call `invalid_input`, as the service's 422 would.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import RewardItem, RewardRequest, RewardSpec
from asyncrl.services.reward.scoring import RequestRejected, Scorer
from asyncrl.services.reward.verifiers import verifier_class
from asyncrl.services.reward.verifiers.base import Verdict


class InlineScorer:
    """`LocalScorer` over the inline verifiers `names`; a name that is not one is a ValueError."""

    def __init__(self, names: Sequence[str]):
        verifiers = {}
        for name in names:
            cls = verifier_class(name)
            if cls is None or not cls.inline:
                raise ValueError(f"{name!r} is not an inline verifier: it cannot be scored locally")
            verifiers[name] = cls(concurrency=1, timeout_s=1.0)  # (inline: neither is used)
        self._scorer = Scorer(verifiers, cache_entries=0, queue_timeout_s=1.0)
        self.verifiers = frozenset(verifiers)

    def score(self, items: list[RewardItem]) -> list[Verdict]:
        try:
            jobs = self._scorer.prepare(RewardRequest.model_construct(items=items))
        except RequestRejected as exc:
            return _rejected(exc, len(items))
        return self._scorer.verdicts_now(jobs)

    def score_group(self, spec: RewardSpec, prompt: str, completions: list[str]) -> list[Verdict]:
        try:
            return self._scorer.judge_group(spec, prompt, completions)
        except RequestRejected as exc:
            return _rejected(exc, len(completions))


def _rejected(exc: RequestRejected, n: int) -> list[Verdict]:
    """The scorer refused the spec: every item of it is `invalid_input`, saying why."""
    details = {"error": f"{exc}: {exc.problems[:3]}"}
    return [Verdict(RewardStatus.invalid_input, None, details) for _ in range(n)]
