"""Verifiers of the reward service, called directly (no HTTP, no worker processes): math answer
extraction and spec checks, the toy verifiers, judge score parsing, code extraction and
normalisation. The math worker pool is tested in tests/integration/reward/test_reward_verifier_processes.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import SpecError
from asyncrl.services.reward.verifiers.code import extract_program, normalise_output
from asyncrl.services.reward.verifiers.judge import ScoreParseError, parse_score
from asyncrl.services.reward.verifiers.math import MathVerifier, answer_region, last_boxed
from asyncrl.services.reward.verifiers.toy import (
    ArithVerifier,
    ReverseVerifier,
    reverse_reward,
    target_from_prompt,
)


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- math


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
    assert verifier.uses_prompt(verifier.parse_spec({})) and not verifier.uses_prompt(
        verifier.parse_spec({"target": "a"})
    )


@pytest.mark.parametrize(
    ("completion", "reward", "well_formed"),
    [("42", 1.0, True), (" 42\n", 1.0, True), ("+42", 1.0, True), ("41", 0.1, True), ("-42", 0.1, True),
     ("42.0", 0.0, False), ("the answer is 42", 0.0, False), ("", 0.0, False), ("9" * 5000, 0.0, False)],
)  # fmt: skip
def test_arith_exact_match_with_format_credit(completion, reward, well_formed):
    verifier = ArithVerifier(concurrency=1, timeout_s=1)
    verdict = run(
        verifier.verify(verifier.parse_spec({"answer": "42", "format_credit": 0.1}), "", completion)
    )
    assert (verdict.status, verdict.reward, verdict.details["well_formed"], verdict.formatted) == (
        RewardStatus.scored,
        reward,
        well_formed,
        well_formed,  # the format arith requires: the completion is an integer
    )


def test_arith_spec_validation():
    verifier = ArithVerifier(concurrency=1, timeout_s=1)
    assert verifier.parse_spec({"answer": 7}).answer == "7"
    assert verifier.parse_spec({"answer": "7"}).format_credit == 0.0
    for bad in [
        {"answer": "seven"},
        {"answer": "1.5"},
        {"answer": True},
        {"answer": "1", "format_credit": 1.0},
        {},
    ]:
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


def _plain(details: dict) -> dict:
    return {k: v for k, v in details.items() if k != "cached"}


@pytest.mark.parametrize("cache_entries", [0, 16])
def test_a_group_judged_at_once_gets_the_batch_paths_verdicts(cache_entries):
    """`Scorer.judge_group` (the rollout's local scoring of a group) answers what `prepare` +
    `score` answer for the same items, spec by spec (a parsed spec kept across calls never
    stands in for another), and refuses what `prepare` refuses."""
    from asyncrl.proto.rewards import RewardItem, RewardRequest, RewardSpec
    from asyncrl.services.reward.scoring import RequestRejected, Scorer

    verifiers = {
        "reverse": ReverseVerifier(concurrency=1, timeout_s=1.0),
        "arith": ArithVerifier(concurrency=1, timeout_s=1.0),
    }
    scorer = Scorer(verifiers, cache_entries=cache_entries, queue_timeout_s=1.0)
    cases = [({"verifier": "reverse"}, "abc>", ["cba", "cbz", "", "abcd"]),
             ({"verifier": "reverse", "target": "xyz"}, "abc>", ["cba", "xyz"]),
             ({"verifier": "arith", "answer": "12", "format_credit": 0.25}, "7+5=", ["12", " 13", "x"]),
             ({"verifier": "reverse"}, "hello>", ["olleh", "cba"])]  # fmt: skip
    for spec_args, prompt, completions in cases * 2:  # twice: the second time from the kept specs (and cache)
        spec = RewardSpec.model_validate(spec_args)
        items = [
            RewardItem(id=str(i), prompt=prompt, completion=c, spec=spec) for i, c in enumerate(completions)
        ]
        batch = asyncio.run(scorer.score(scorer.prepare(RewardRequest(items=items)))).results
        group = scorer.judge_group(spec, prompt, completions)
        assert [(v.status, v.reward, _plain(v.details), v.formatted) for v in group] == [
            (r.status, r.reward, _plain(r.details), r.formatted) for r in batch
        ]
    # served again (from the cache when there is one), the format verdict is kept
    arith = RewardSpec.model_validate({"verifier": "arith", "answer": "12", "format_credit": 0.25})
    again = scorer.judge_group(arith, "7+5=", ["12", " 13", "x"])
    assert [(v.reward, v.formatted, v.details.get("cached", False)) for v in again] == [
        (1.0, True, cache_entries > 0), (0.25, True, cache_entries > 0), (0.0, False, cache_entries > 0)
    ]  # fmt: skip
    assert {
        v.formatted
        for v in scorer.judge_group(RewardSpec.model_validate({"verifier": "reverse"}), "a>", ["a"])
    } == {None}  # reverse has no notion of format
    expected = [1.0, 2 / 3, 0.0, 0.25]
    assert [v.reward for v in scorer.judge_group(RewardSpec.model_validate({"verifier": "reverse"}), "abc>",
                                                  ["cba", "cbz", "", "abcd"])] == pytest.approx(expected)  # fmt: skip
    assert [v.reward for v in scorer.judge_group(RewardSpec.model_validate({"verifier": "reverse", "target": "xyz"}),
                                                  "abc>", ["cba", "xyz"])] == [0.0, 1.0]  # fmt: skip
    with pytest.raises(RequestRejected, match="invalid item"):
        scorer.judge_group(RewardSpec.model_validate({"verifier": "reverse", "target": ""}), "abc>", ["x"])
    with pytest.raises(RequestRejected):  # not a verifier of this scorer
        scorer.judge_group(RewardSpec.model_validate({"verifier": "math", "answer": "1"}), "", ["1"])


def test_builtin_verifier_registry_names_every_verifier_and_its_spec_model():
    """Every built-in verifier parses its spec with the model `proto.verifiers` publishes for
    its name (the one the rollout checks submissions with), and `INLINE` names exactly the
    inline ones."""
    import importlib

    from asyncrl.proto.verifiers import INLINE, SPECS
    from asyncrl.services.reward.verifiers import BUILTIN, Verifier, verifier_class

    assert set(SPECS) == set(BUILTIN)
    for name in BUILTIN:
        cls = verifier_class(name)
        assert cls.name == name and cls.Spec is SPECS[name] and cls.inline == (name in INLINE)
    for module in ("toy", "math", "code", "judge", "rgym"):
        importlib.import_module(f"asyncrl.services.reward.verifiers.{module}")

    def concrete(cls) -> list[type]:  # (shared bases such as PooledVerifier have no name)
        return [c for sub in cls.__subclasses__() for c in [sub, *concrete(sub)] if "name" in vars(c)]

    named = {cls.name for cls in concrete(Verifier)}
    assert {"math", "reasoning_gym"} <= named <= set(BUILTIN)
    assert verifier_class("custom") is None


def test_the_local_scorer_entry_point_scores_inline_verifiers_only():
    """`asyncrl.local_scorers:inline` (pyproject) is this package's `InlineScorer`: the
    service's own verdicts, and a refused spec makes that call's items `invalid_input`."""
    from importlib.metadata import entry_points

    from asyncrl.proto.rewards import RewardItem, RewardSpec
    from asyncrl.proto.verifiers import LOCAL_SCORER, LOCAL_SCORERS
    from asyncrl.services.reward.local import InlineScorer

    (found,) = entry_points(group=LOCAL_SCORERS, name=LOCAL_SCORER)
    assert found.load() is InlineScorer
    scorer = InlineScorer(["reverse"])
    assert scorer.verifiers == {"reverse"}
    spec = RewardSpec(verifier="reverse", target="ab")
    assert [v.reward for v in scorer.score_group(spec, "", ["ab", "ax"])] == [1.0, 0.5]
    items = [RewardItem(id="0", completion="ab", spec=spec)]
    assert [(v.status, v.reward) for v in scorer.score(items)] == [(RewardStatus.scored, 1.0)]
    bad = RewardSpec(verifier="reverse", target="ab", extra=1)
    assert {v.status for v in scorer.score_group(bad, "", ["ab", "ab"])} == {RewardStatus.invalid_input}
    with pytest.raises(ValueError, match="'math' is not an inline verifier"):
        InlineScorer(["math"])
