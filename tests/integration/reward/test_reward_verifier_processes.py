"""Reward verifiers that need processes of their own: math through real math-verify worker
processes (a hang is killed and replaced), and a fresh interpreter that proves the reward
service never imports torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from asyncrl.proto.records import RewardStatus
from asyncrl.services.reward.verifiers.math import MathVerifier

MATH_TIMEOUT_S = 3.0


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- math


async def _math_batch(cases: list[tuple[str, str]], timeout_s: float = MATH_TIMEOUT_S, max_chars: int = 8192):
    verifier = MathVerifier(workers=2, timeout_s=timeout_s, max_chars=max_chars, memory_mb=2048)
    await verifier.start()
    try:
        spec_of = verifier.parse_spec
        results = []
        for gold, completion in cases:
            started = time.monotonic()
            verdict = await verifier.verify(spec_of({"answer": gold}), "", completion)
            results.append((verdict, time.monotonic() - started))
        return results, verifier.pool.alive()
    finally:
        await verifier.close()


EQUIVALENT = [
    (r"\frac{1}{2}", r"The answer is $\boxed{0.5}$."),
    ("0.5", r"so we get \boxed{\frac{1}{2}}"),
    (r"2\sqrt2", r"\boxed{\sqrt{8}}"),
    (r"\sqrt8", r"Therefore $\boxed{2\sqrt{2}}$"),
    (r"\{1, 2, 3\}", r"\boxed{\{3, 1, 2\}}"),
    (r"(1, 2]", r"the solution set is \boxed{(1,2]}"),
    (r"[0, \infty)", r"\boxed{[0,\infty)}"),
    ("3", r"First \boxed{5} is wrong; the final answer is \boxed{3}"),  # the last box wins
]
NOT_EQUIVALENT = [
    (r"\frac{1}{2}", r"\boxed{0.51}"),
    (r"2\sqrt2", r"\boxed{\sqrt{6}}"),
    (r"\{1, 2, 3\}", r"\boxed{\{1, 2\}}"),
    (r"(1, 2]", r"\boxed{[1, 2]}"),
    ("3", r"\boxed{3} was my first guess but the answer is \boxed{5}"),
]


def test_math_equivalents_and_non_equivalents():
    results, _ = run(_math_batch(EQUIVALENT + NOT_EQUIVALENT))
    got = [(v.status, v.reward) for v, _ in results]
    want = [(RewardStatus.scored, 1.0)] * len(EQUIVALENT) + [(RewardStatus.scored, 0.0)] * len(NOT_EQUIVALENT)
    assert got == want, [(case, g) for case, g, w in zip(EQUIVALENT + NOT_EQUIVALENT, got, want) if g != w]


# (case, completion against the gold 14, strict: (reward, formatted), lenient: (reward, formatted))
FORMAT_CASES = [
    ("boxed, right", r"7 + 7 = 14, so \boxed{14}.", (1.0, True), (1.0, True)),
    ("boxed, wrong", r"7 + 7 = 15, so \boxed{15}.", (0.0, True), (0.0, True)),
    ("unboxed, right", "7 + 7 = 14. The answer is 14.", (0.0, False), (1.0, False)),
    ("garbage", "the the the apples ?!", (0.0, False), (0.0, False)),
    ("empty box", r"I think \boxed{} is it", (0.0, False), (0.0, False)),
    ("Answer: line, right", "7 + 7\nAnswer: 14", (1.0, True), (1.0, False)),  # lenient: only a box is a mark
]  # fmt: skip


def test_math_says_whether_the_answer_had_the_required_format():
    """`formatted`: strict mode's marks (a box, an answer tag, an answer line) or lenient mode's
    box, with math-verify reading an answer out of it; a paid lenient answer without a box is
    right and not formatted."""

    async def both() -> list:
        verifier = MathVerifier(workers=1, timeout_s=MATH_TIMEOUT_S, max_chars=8192, memory_mb=2048)
        await verifier.start()
        try:
            return [
                await verifier.verify(verifier.parse_spec({"answer": "14", "strict": strict}), "", completion)
                for _, completion, *_ in FORMAT_CASES
                for strict in (True, False)
            ]
        finally:
            await verifier.close()

    verdicts = iter(run(both()))
    for case, _, strict, lenient in FORMAT_CASES:
        for mode, want in (("strict", strict), ("lenient", lenient)):
            v = next(verdicts)
            assert (v.status, v.reward, v.formatted) == (RewardStatus.scored, *want), (case, mode, v)


def test_math_unparseable_gold_is_invalid_input_and_hang_is_killed_and_replaced():
    adversarial = ("$\\frac{1}{" * 10_000)[:100_000]  # 100 kB of unbalanced LaTeX, no \boxed
    cases = [
        (r"\frac{", r"\boxed{1}"),  # gold that does not parse
        ("???", r"\boxed{1}"),
        ("1", r"\boxed{9^{9^{9^{9}}}}"),  # sympy evaluates a power tower forever
        ("2", adversarial),
        ("7", r"\boxed{7}"),  # the pool still answers after a worker was killed
    ]
    results, alive = run(_math_batch(cases))
    (bad1, _), (bad2, _), (hang, hang_s), (big, big_s), (after, _) = results
    assert (bad1.status, bad1.reward, bad1.details["reason"], bad1.formatted) == (
        RewardStatus.invalid_input,
        None,
        "gold_unparseable",
        None,  # not judged: no format verdict either
    )
    assert (bad2.status, bad2.details["reason"]) == (RewardStatus.invalid_input, "gold_unparseable")
    assert (hang.status, hang.details["reason"]) == (RewardStatus.timeout, "math_timeout")
    assert MATH_TIMEOUT_S <= hang_s < MATH_TIMEOUT_S + 2.0
    assert big.status in (RewardStatus.scored, RewardStatus.timeout)
    assert big_s < MATH_TIMEOUT_S + 2.0
    if big.status is RewardStatus.scored:
        assert big.reward == 0.0 and big.details["truncated"] is True
    assert (after.status, after.reward) == (RewardStatus.scored, 1.0)
    assert alive == 2


# ---------------------------------------------------------------- no torch


def test_reward_service_never_imports_torch():
    probe = (
        "import sys\n"
        "from asyncrl.services.reward.app import build_app\n"
        "from asyncrl.services.reward.config import RewardSettings\n"
        "build_app(RewardSettings(code_enabled=False, judge_base_url='http://127.0.0.1:9/v1'))\n"
        "import asyncrl.services.reward.main, asyncrl.services.reward.verifiers.code, asyncrl.services.reward.sandbox\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "False"]
