"""`summarize`: an evaluation's figures from its items, each checked against arithmetic written
here. Strict accuracy counts every item; format rate and accuracy among formatted answers come
from the verifiers' format verdicts (`EvalItem.formatted`), so formatting and learning are
reported apart."""

from __future__ import annotations

import pytest

from asyncrl.proto.evals import EvalItem, EvalSummary
from asyncrl.proto.records import RewardStatus
from asyncrl.services.rollout.evaluations.evaluator import summarize

S, TIMEOUT, INVALID = RewardStatus.scored, RewardStatus.timeout, RewardStatus.invalid_input


def item(index: int, reward: float | None, formatted: bool | None, status=S, tokens: int = 10) -> EvalItem:
    return EvalItem(
        index=index,
        prompt_id=f"p{index}",
        completion="",
        completion_tokens=tokens,
        finish_reason="stop",
        version=3,
        reward=reward,
        reward_status=status,
        formatted=formatted,
    )


def test_strict_math_items_hand_computed():
    """Eight strict-math items: 2 formatted and right, 2 formatted and wrong, 3 unformatted
    (reward 0), 1 timed out (no verdict at all, so neither right nor formatted)."""
    items = [
        item(0, 1.0, True, tokens=20),
        item(1, 1.0, True, tokens=30),
        item(2, 0.0, True, tokens=40),
        item(3, 0.0, True, tokens=10),
        item(4, 0.0, False, tokens=100),
        item(5, 0.0, False, tokens=100),
        item(6, 0.0, False, tokens=100),
        item(7, None, None, status=TIMEOUT, tokens=0),
    ]
    got = summarize(items)
    assert got == {
        "accuracy": 2 / 8,  # right, over every item (the timeout is wrong)
        "formatted": 4,
        "format_rate": 4 / 8,  # the timeout needed a format and has none
        "formatted_accuracy": 2 / 4,  # right among the formatted
        "mean_reward": 2 / 7,  # over the 7 scored items
        "mean_length": 400 / 8,
        "correct": 2,
        "scored": 7,
        "statuses": {"scored": 7, "timeout": 1},
    }
    # strict accuracy = format rate x accuracy among formatted (every right answer is formatted)
    assert got["accuracy"] == got["format_rate"] * got["formatted_accuracy"]
    EvalSummary.model_validate({"eval_id": "e", "name": "n", "source": "api", "state": "done",
                                "prompts": 8, "created_at": 0.0, **got})  # fmt: skip


def test_nothing_formatted_gives_a_null_accuracy_among_formatted():
    """Three unboxed answers and an invalid gold: format rate 0, accuracy among formatted
    undefined (null, never 0 or a division by zero)."""
    items = [
        item(0, 0.0, False),
        item(1, 0.0, False),
        item(2, 0.0, False),
        item(3, None, None, status=INVALID),
    ]
    got = summarize(items)
    assert (got["accuracy"], got["formatted"], got["format_rate"], got["formatted_accuracy"]) == (
        0.0,
        0,
        0.0,
        None,
    )


def test_a_lenient_right_answer_without_the_format_is_not_counted_among_formatted():
    """Lenient math pays an unboxed right answer; it is right but not formatted, so it raises
    accuracy and leaves accuracy among formatted answers alone: 1 of the 2 formatted is right."""
    items = [item(0, 1.0, False), item(1, 1.0, True), item(2, 0.0, True), item(3, 0.0, False)]
    got = summarize(items)
    assert (got["accuracy"], got["formatted"], got["format_rate"], got["formatted_accuracy"]) == (
        2 / 4,
        2,
        2 / 4,
        1 / 2,
    )


def test_verifiers_without_a_format_give_no_format_figures():
    """`reverse` has no notion of format: no item has a verdict, so all three are null."""
    got = summarize([item(0, 1.0, None), item(1, 0.5, None), item(2, None, None, status=TIMEOUT)])
    assert (got["accuracy"], got["formatted"], got["format_rate"], got["formatted_accuracy"]) == (
        1 / 3,
        None,
        None,
        None,
    )


def test_a_mixed_set_counts_format_only_over_the_items_that_need_one():
    """Two math items (one formatted and right, one unformatted) beside two `reverse` items
    (scored, no format verdict): format rate 1 / 2, not 1 / 4; accuracy still over all 4."""
    items = [item(0, 1.0, True), item(1, 0.0, False), item(2, 1.0, None), item(3, 0.25, None)]
    got = summarize(items)
    assert (got["accuracy"], got["formatted"], got["format_rate"], got["formatted_accuracy"]) == (
        2 / 4,
        1,
        1 / 2,
        1.0,
    )


@pytest.mark.parametrize("status", [RewardStatus.error, RewardStatus.timeout, RewardStatus.invalid_input])
def test_an_unscored_item_cannot_claim_a_format(status):
    from asyncrl.proto.rewards import RewardResult

    with pytest.raises(ValueError, match="formatted must be None"):
        RewardResult(id="0", status=status, formatted=True)
    assert RewardResult(id="0", status=RewardStatus.scored, reward=0.0, formatted=False).formatted is False
    assert (
        RewardResult.model_validate({"id": "0", "status": "scored", "reward": 1.0}).formatted is None
    )  # old servers
