"""The `reasoning_gym` spec (proto/reasoning_gym.py) against the installed reasoning-gym: the
dataset names it accepts are the release's registry, and what it refuses is refused with a
message naming the field. Strict math's answer marking (services/reward/verifiers/math.py) is a
pure function, tested here on written-out completions."""

from __future__ import annotations

import importlib.metadata

import pytest
import reasoning_gym
import reasoning_gym.factory

from asyncrl.proto.reasoning_gym import DATASETS, RELEASE, ReasoningGymSpec, entry_digest
from asyncrl.proto.verifiers import SPECS, SpecError, validate_spec
from asyncrl.services.reward.verifiers.math import marked_answer


def test_the_dataset_names_are_the_installed_release_registry():
    assert importlib.metadata.version("reasoning-gym") == RELEASE
    assert set(reasoning_gym.factory.DATASETS) == DATASETS
    assert SPECS["reasoning_gym"] is ReasoningGymSpec


def spec(**fields):
    return validate_spec(ReasoningGymSpec, {"dataset": "gsm_symbolic", "config": {"seed": 1, "size": 4},
                                            "index": 0, **fields})  # fmt: skip


def test_a_spec_names_one_entry_of_a_known_dataset():
    ok = spec(index=3, entry_sha256="a" * 64)
    assert (ok.dataset, ok.config, ok.index, ok.boxed_fallback) == (
        "gsm_symbolic",
        {"seed": 1, "size": 4},
        3,
        False,
    )
    refusals = {
        "dataset": ({"dataset": "gsm_symbolc"}, "unknown reasoning-gym 0.1.25 dataset 'gsm_symbolc'"),
        "config": ({"config": {"size": 4}}, "config.seed must be a non-negative integer"),
        "config ": ({"config": {"seed": 1, "size": 0}}, "config.size must be between 1"),
        "spec": ({"index": 4}, "index 4 is not below config.size 4"),
        "entry_sha256": ({"entry_sha256": "xyz"}, "should match pattern"),
        "extra": ({"answer": "70"}, "Extra inputs are not permitted"),
    }
    for field, (bad, message) in refusals.items():
        with pytest.raises(SpecError) as exc:
            spec(**bad)
        assert message in str(exc.value), (field, str(exc.value))


def test_the_digest_covers_question_and_answer():
    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=5, size=2)[1]
    again = reasoning_gym.create_dataset("basic_arithmetic", seed=5, size=2)[1]
    assert entry_digest(entry) == entry_digest(again)
    assert entry_digest({**entry, "answer": entry["answer"] + "0"}) != entry_digest(entry)
    assert entry_digest({**entry, "question": entry["question"] + " "}) != entry_digest(entry)


@pytest.mark.parametrize(
    ("completion", "marked"),
    [
        ("so it is \\boxed{14}.", "\\boxed{14}"),
        ("<answer>3</answer> no wait \\boxed{4}", "\\boxed{4}"),  # the box wins over the tag
        ("<answer>1</answer> then <answer> 14 </answer>", "14"),  # the last tag, stripped
        ("<answer>\\frac{1}{2}</answer>", "$\\frac{1}{2}$"),  # bare LaTeX is wrapped to parse
        ("work\n#### 14", "14"),
        ("work\nAnswer: 14\nthanks", "14"),
        ("**Final Answer:** 14", "14"),
        ("maybe 14", None),
        ("the answer is 14", None),  # prose is not a marker
        ("Answer:\n", None),  # a marker with nothing after it
        ("<answer></answer>", None),
    ],
)
def test_strict_math_takes_only_a_marked_answer(completion, marked):
    assert marked_answer(completion, 8192) == marked
