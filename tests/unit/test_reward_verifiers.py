"""Verifiers of the reward service, called directly (no HTTP): math through real math-verify
worker processes, the toy verifiers, judge score parsing, code extraction and normalisation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from proto.records import RewardStatus
from services.reward.verifiers.base import SpecError
from services.reward.verifiers.code import extract_program, normalise_output
from services.reward.verifiers.judge import ScoreParseError, parse_score
from services.reward.verifiers.math import MathVerifier, answer_region, last_boxed
from services.reward.verifiers.toy import ArithVerifier, ReverseVerifier, reverse_reward, target_from_prompt

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
    assert (bad1.status, bad1.reward, bad1.details["reason"]) == (RewardStatus.invalid_input, None, "gold_unparseable")
    assert (bad2.status, bad2.details["reason"]) == (RewardStatus.invalid_input, "gold_unparseable")
    assert (hang.status, hang.details["reason"]) == (RewardStatus.timeout, "math_timeout")
    assert MATH_TIMEOUT_S <= hang_s < MATH_TIMEOUT_S + 2.0
    assert big.status in (RewardStatus.scored, RewardStatus.timeout)
    assert big_s < MATH_TIMEOUT_S + 2.0
    if big.status is RewardStatus.scored:
        assert big.reward == 0.0 and big.details["truncated"] is True
    assert (after.status, after.reward) == (RewardStatus.scored, 1.0)
    assert alive == 2


def test_last_boxed_and_answer_region():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{2}{3}} c", 100) == r"\boxed{\frac{2}{3}}"
    assert last_boxed(r"\boxed{unclosed", 100) is None
    assert last_boxed("\\boxed{" + "{" * 50 + "}" * 50 + "}", 20) is None  # longer than the cap
    assert answer_region("x" * 50 + "42", 10) == ("xxxxxxxx42", True)
    assert answer_region(r"y" * 50 + r"\boxed{4}", 10) == (r"\boxed{4}", False)


def test_math_spec_requires_answer():
    verifier = MathVerifier(workers=1, timeout_s=1, max_chars=100, memory_mb=1024)
    with pytest.raises(SpecError, match="answer"):
        verifier.parse_spec({})
    with pytest.raises(SpecError, match="anwser: Extra inputs"):
        verifier.parse_spec({"answer": "1", "anwser": "2"})


# ---------------------------------------------------------------- toy tasks


def test_reverse_reward_is_dense_and_exact_answer_is_the_only_maximum():
    target = "dcba"
    assert reverse_reward(target, "dcba") == (1.0, 4)
    assert reverse_reward(target, "dcbx") == (0.75, 3)
    assert reverse_reward(target, "dcb") == (0.75, 3)  # missing char: 3 matched / 4
    assert reverse_reward(target, "dcbaa") == (0.8, 4)  # extra char: 4 matched / 5
    assert reverse_reward(target, "") == (0.0, 0)
    assert reverse_reward(target, "abcd") == (0.0, 0)
    for wrong in ["dcb", "dcbaa", "dcbax", "xdcba", "dcba "]:
        assert reverse_reward(target, wrong)[0] < 1.0


def test_reverse_verifier_with_target_and_from_prompt():
    verifier = ReverseVerifier(concurrency=1, timeout_s=1)
    explicit = run(verifier.verify(verifier.parse_spec({"target": "olleh"}), "ignored", "olleX"))
    assert (explicit.status, explicit.reward) == (RewardStatus.scored, 0.8)
    assert target_from_prompt("abcd>") == "dcba"
    assert target_from_prompt("  reverse: hij >  ") == "jih :esrever"
    derived = run(verifier.verify(verifier.parse_spec({}), "abcd>", "dcba"))
    assert (derived.status, derived.reward, derived.details["target_len"]) == (RewardStatus.scored, 1.0, 4)
    empty = run(verifier.verify(verifier.parse_spec({}), "  >", "x"))
    assert (empty.status, empty.details["reason"]) == (RewardStatus.invalid_input, "empty_target")
    assert verifier.uses_prompt(verifier.parse_spec({})) and not verifier.uses_prompt(verifier.parse_spec({"target": "a"}))


@pytest.mark.parametrize(
    ("completion", "reward", "well_formed"),
    [("42", 1.0, True), (" 42\n", 1.0, True), ("+42", 1.0, True), ("41", 0.1, True), ("-42", 0.1, True),
     ("42.0", 0.0, False), ("the answer is 42", 0.0, False), ("", 0.0, False), ("9" * 5000, 0.0, False)],
)  # fmt: skip
def test_arith_exact_match_with_format_credit(completion, reward, well_formed):
    verifier = ArithVerifier(concurrency=1, timeout_s=1)
    verdict = run(verifier.verify(verifier.parse_spec({"answer": "42", "format_credit": 0.1}), "", completion))
    assert (verdict.status, verdict.reward, verdict.details["well_formed"]) == (RewardStatus.scored, reward, well_formed)


def test_arith_spec_validation():
    verifier = ArithVerifier(concurrency=1, timeout_s=1)
    assert verifier.parse_spec({"answer": 7}).answer == "7"
    assert verifier.parse_spec({"answer": "7"}).format_credit == 0.0
    for bad in [{"answer": "seven"}, {"answer": "1.5"}, {"answer": True}, {"answer": "1", "format_credit": 1.0}, {}]:
        with pytest.raises(SpecError):
            verifier.parse_spec(bad)


# ---------------------------------------------------------------- judge score parsing


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The response is fine.\nScore: 7", 7.0),
        ("**Score:** 8", 8.0),
        ("score = 6.5", 6.5),
        ("Final score: 9/10", 9.0),
        ("I'd give it a score of 4 out of 10.", 4.0),
        ("Score: 3\nOn reflection the proof has a gap.\nScore: 2", 2.0),
        ('```json\n{"reasoning": "mostly right", "score": 6}\n```', 6.0),
        ('{"score": "5"} and then nothing else', 5.0),
        ('Score: 9 ... but the required format is JSON: {"score": 1}', 1.0),
        ("<think>Score: 10 would be too generous</think>The answer is weak. Score: 3", 3.0),
        ("SCORE:0", 0.0),
    ],
)
def test_parse_score_messy_outputs(text, score):
    assert parse_score(text, (0.0, 10.0)) == score


@pytest.mark.parametrize(
    "text",
    [
        "The answer looks great!",
        "Score: eleven",
        "Score: 12",  # outside the scale
        "Score: -1",
        "Score: 7/5",  # denominator is not the scale's max: ambiguous
        '{"score": "high"}',
        '{"grade": 7}',
        "",
    ],
)
def test_parse_score_rejects_unparseable(text):
    with pytest.raises(ScoreParseError):
        parse_score(text, (0.0, 10.0))


def test_parse_score_custom_scale():
    assert parse_score("Score: 4/5", (1.0, 5.0)) == 4.0
    with pytest.raises(ScoreParseError):
        parse_score("Score: 0", (1.0, 5.0))


# ---------------------------------------------------------------- code helpers


def test_extract_program_takes_last_fenced_block():
    text = "Try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\ndone"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"


def test_normalise_output():
    assert normalise_output("1 2 \n3\t\n\n") == normalise_output("1 2\n3")
    assert normalise_output("1 2\n3") != normalise_output("1  2\n3")
    assert normalise_output("12") != normalise_output("1\n2")


# ---------------------------------------------------------------- no torch


def test_reward_service_never_imports_torch():
    probe = (
        "import sys\n"
        "from services.reward.app import build_app\n"
        "from services.reward.config import RewardSettings\n"
        "build_app(RewardSettings(code_enabled=False, judge_base_url='http://127.0.0.1:9/v1'))\n"
        "import services.reward.main, services.reward.verifiers.code, services.reward.sandbox\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
