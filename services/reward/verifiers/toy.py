"""Toy verifiers of the CPU demo: `reverse` (dense per-character reward) and `arith` (exact match).

Both are pure string functions, cheap enough to run on the event loop: `inline` verifiers.
"""

from __future__ import annotations

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import INTEGER, MAX_TARGET_CHARS, ArithSpec, ReverseSpec
from asyncrl.services.reward.verifiers.base import Verdict, Verifier


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


class ArithVerifier(Verifier):
    name = "arith"
    description = (
        "Exact-match integer arithmetic: 1 if the stripped completion is the integer `answer`, "
        "`format_credit` if it is some other integer, 0 otherwise; formatted: the completion is an integer."
    )
    Spec = ArithSpec
    inline = True

    def judge(self, spec: ArithSpec, prompt: str, completion: str) -> Verdict:
        text = completion.strip()
        if not INTEGER.fullmatch(text):
            return Verdict.scored(0.0, formatted=False, well_formed=False)
        correct = int(text) == int(spec.answer)
        return Verdict.scored(
            1.0 if correct else spec.format_credit, formatted=True, well_formed=True, correct=correct
        )
