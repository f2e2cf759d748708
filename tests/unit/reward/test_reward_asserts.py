"""The code verifier's assert splitting (services/reward/verifiers/asserts.py): each supported
form parsed into its call and expected value, unsplittable forms refused with their line, the
comparisons made on the trusted side, the plain-data codec, and the result line's framing."""

from __future__ import annotations

import json
import marshal
import math

import pytest
from pydantic import ValidationError

from asyncrl.proto.verifiers import CodeSpec
from asyncrl.services.reward.verifiers.asserts import (
    BadResults,
    Check,
    Unsplittable,
    calls_line,
    first_failure,
    read_results,
    split_asserts,
)
from asyncrl.services.reward.verifiers.call_harness import NotPlain, decode, to_json

INF = float("inf")


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ("assert f(1, 2) == 3", Check(1, "f", (1, 2), {}, "==", 3)),
        ("assert 3 == f(1, 2)", Check(1, "f", (1, 2), {}, "==", 3, swapped=True)),
        ("assert f(x=[1, 2]) != 'a'", Check(1, "f", (), {"x": [1, 2]}, "!=", "a")),
        ("assert f(2) >= -1.5", Check(1, "f", (2,), {}, ">=", -1.5)),
        ("assert f(1) in [1, 2]", Check(1, "f", (1,), {}, "in", [1, 2])),
        ("assert 3 not in f(4)", Check(1, "f", (4,), {}, "not in", 3, swapped=True)),
        ("assert f(1) is True", Check(1, "f", (1,), {}, "is", True)),
        ("assert f(1) is not None", Check(1, "f", (1,), {}, "is not", None)),
        ("assert f(1)", Check(1, "f", (1,))),
        ("assert not f(0)", Check(1, "f", (0,), op="falsy")),
        ("assert abs(f(1.5) - 0.5) < 1e-6", Check(1, "f", (1.5,), {}, "<", 1e-6, distance_from=0.5)),
        ("assert 1e-6 >= abs(0.5 - f(1.5))", Check(1, "f", (1.5,), {}, ">=", 1e-6, True, distance_from=0.5)),
        (
            "import math\nassert math.isclose(f(2), 4.0, rel_tol=1e-3, abs_tol=0)",
            Check(2, "f", (2,), {}, "isclose", 4.0, tol=(("rel_tol", 1e-3), ("abs_tol", 0))),
        ),
        ("from math import isclose\nassert isclose(4.0, f(2))", Check(2, "f", (2,), {}, "isclose", 4.0)),
        ("import math as m\nassert m.isclose(f(2), 4.0)", Check(2, "f", (2,), {}, "isclose", 4.0)),
        ("assert f(1) == 2, 'message: ' + str(f(1))", Check(1, "f", (1,), {}, "==", 2)),
        (
            "assert f((1, 2), {3}, {'k': -4}) == (float('inf'), -float('inf'), set(), tuple([1]))",
            Check(1, "f", ((1, 2), {3}, {"k": -4}), {}, "==", (INF, -INF, set(), (1,))),
        ),
        (
            "MOD = 10**9 + 7\nassert f(MOD) == MOD - 1",
            Check(2, "f", (1_000_000_007,), {}, "==", 1_000_000_006),
        ),
        ("assert f(1) == 1 / 4", Check(1, "f", (1,), {}, "==", 0.25)),
    ],
)
def test_each_supported_form_gives_its_call_and_expected_value(source, want):
    assert split_asserts(source) == [want]


def test_several_asserts_keep_their_order_lines_and_skip_true_constants():
    source = '"""Tests."""\nimport math\n\nassert True\nassert f(1) == 1\npass\nassert g("x") and not h()\n'
    assert split_asserts(source) == [
        Check(5, "f", (1,), {}, "==", 1),
        Check(7, "g", ("x",)),
        Check(7, "h", (), op="falsy"),
    ]


def test_humaneval_check_candidate_is_expanded_for_the_called_or_spec_entry_point():
    source = (
        "METADATA = {'author': 'jt', 'dataset': 'test'}\n"
        "\n"
        "def check(candidate):\n"
        "    assert candidate([1.0, 2.0], 0.5) == False\n"
        "    assert abs(candidate([1.0], 0.3) - 1) < 1e-6\n"
        "    assert True, 'This prints if this assert fails'\n"
    )
    want = [
        Check(4, "has_close", ([1.0, 2.0], 0.5), {}, "==", False),
        Check(5, "has_close", ([1.0], 0.3), {}, "<", 1e-6, distance_from=1),
    ]
    assert split_asserts(source + "\ncheck(has_close)\n") == want
    assert split_asserts(source, entry_point="has_close") == want
    with pytest.raises(Unsplittable, match="no assert"):
        split_asserts(source)  # check is never called: nothing would be tested


@pytest.mark.parametrize(
    ("source", "where"),
    [
        ("x = f(1)\nassert x == 2", "line 1: setup"),
        ("assert f(1) == 1\nfor i in range(3):\n    assert f(i) == i", "line 2: unsupported statement"),
        ("assert f(g(1)) == 2", "line 1: `g(1)` is not a literal"),
        ("assert set(f(1)) == {1}", "line 1"),
        ("assert f(1) == g(2)", "line 1: `g(2)` is not a literal"),
        ("assert 0 < f(1) < 2", "line 1: unsupported assert"),
        ("assert f(1) is 5", "line 1: `is` only with None, True or False"),
        ("assert f(b'x') == 1", "line 1"),
        ("assert f(1j) == 1", "line 1"),
        ("assert f(**{'a': 1}) == 1", "line 1: `**` in a call"),
        ("assert obj.f(1) == 1", "line 1: neither side is a call"),
        ("assert f(1) == 2**1000", "line 1: arithmetic"),
        ("assert f(1) == 1 / 0", "line 1: division by zero"),
        ("assert f(1) == [1, 2][0]", "line 1"),
        ("import os\nassert f(1) == 1", "line 1: unsupported statement"),
        ("def check(c):\n    print(c(1))\ncheck(f)", "line 2: unsupported statement"),
        ("def helper(x):\n    pass\nassert helper(1) == 1", "not a function of the program"),
        ("assert math.isclose(f(1), 1.0, 1e-3)", "line 1"),
        ("assert math.isclose(f(1), 1.0, tol=1)", "isclose takes only"),
        ("assert False", "false constant"),
        ("assert f(1) ==", "does not parse"),
        ("import math\n", "no assert"),
    ],
)
def test_unsplittable_forms_are_refused_with_their_line(source, where):
    with pytest.raises(Unsplittable) as refused:
        split_asserts(source)
    assert where in str(refused.value)


def test_entry_point_without_a_check_function_is_unsplittable():
    with pytest.raises(Unsplittable, match="no `def check"):
        split_asserts("assert f(1) == 1", entry_point="f")


def test_the_judge_compares_plain_values_as_python_does():
    eq_tuple = Check(1, "f", (), {}, "==", (1, 2))
    assert eq_tuple.judge((1, 2)) and not eq_tuple.judge([1, 2])  # a tuple stays a tuple
    assert Check(1, "f", (), {}, "==", 1).judge(1.0) and Check(1, "f", (), {}, "==", 1).judge(True)
    assert not Check(1, "f", (), {}, "==", math.nan).judge(math.nan)
    assert not Check(1, "f", (), {}, "<", 3).judge("a")  # TypeError: fails, does not raise
    # abs(0.3 - 0.1 * 3) = 5.55e-17: within 1e-9, not within 1e-17
    assert Check(1, "f", (), {}, "<", 1e-9, distance_from=0.3).judge(0.1 * 3)
    assert not Check(1, "f", (), {}, "<", 1e-17, distance_from=0.3).judge(0.1 * 3)
    assert not Check(1, "f", (), {}, "<", 1e-9, distance_from=0.3).judge("0.3")
    # isclose(1.0, 1.001): |diff| 0.001 <= 1e-2 * 1.001 but > 1e-4 * 1.001
    assert Check(1, "f", (), {}, "isclose", 1.0, tol=(("rel_tol", 1e-2),)).judge(1.001)
    assert not Check(1, "f", (), {}, "isclose", 1.0, tol=(("rel_tol", 1e-4),)).judge(1.001)
    assert Check(1, "f", (), {}, "isclose", INF).judge(INF)
    assert Check(1, "f", (), {}, "is", True).judge(True) and not Check(1, "f", (), {}, "is", True).judge(1)
    assert Check(1, "f", (), {}, "in", "abc", swapped=False).judge("b")
    assert Check(1, "f", (), {}, "in", 3, swapped=True).judge({3, 4})
    assert Check(1, "f").judge([0]) and not Check(1, "f").judge([])
    assert Check(1, "f", op="falsy").judge(0) and not Check(1, "f", op="falsy").judge("x")


def test_codec_round_trips_plain_data_and_refuses_the_rest():
    value = [None, True, -3, 2.5, INF, "s", (1, [2]), {3, (4,)}, frozenset({5}), {1: {"a": (None,)}}, []]
    text = to_json(value)
    assert decode(json.loads(text)) == value
    assert type(decode(json.loads(text))[6]) is tuple and type(decode(json.loads(text))[8]) is frozenset
    assert to_json([-INF, 'é\n"', (1,)]) == '[{"float": "-inf"}, "\\u00e9\\n\\"", {"tuple": [1]}]'
    assert math.isnan(decode(json.loads(to_json(math.nan))))

    class Sneaky(list):
        def __eq__(self, other):
            return True

    for bad in (Sneaky([1]), object(), b"x", 1j, [1, (x for x in ())], {"k": {1: object()}}, 1 << 20_000):
        with pytest.raises(NotPlain):
            to_json(bad)
    for bad in (
        {"tuple": 1},
        {"nope": []},
        {"a": [], "b": []},
        {"set": [[1]]},
        {"float": "1.5"},
        {"dict": [[1]]},
    ):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


def test_calls_line_carries_the_calls_and_never_the_expected_values():
    checks = split_asserts("assert f((1, 2), k={3}) == 'EXPECTED-1'\nassert abs(g() - 17.25) < 0.5")
    calls = marshal.loads(bytes.fromhex(calls_line(checks)))
    assert calls == [("f", ((1, 2),), {"k": {3}}), ("g", (), {})]
    assert "EXPECTED" not in repr(calls) and "17.25" not in repr(calls) and "0.5" not in repr(calls)


def test_result_line_is_found_among_program_output_and_checked():
    nonce = "ab" * 16
    good = f'junk\n{nonce}[["ok", {{"tuple": [1, 2]}}], ["not_plain", "Foo"]]\nmore junk\n'
    assert read_results(good.encode(), nonce, 2) == [("ok", (1, 2)), ("not_plain", "Foo")]
    for stdout, why in [
        (b'[["ok", 1]]\n', "no result line"),  # no nonce: an early exit
        (f'\n{nonce}[["ok", 1]]'.encode(), "expected 2 results"),
        (f'\n{nonce}[["ok", NaN], ["ok", 1]]'.encode(), "bare NaN"),
        (f'\n{nonce}[["ok", 1], ["maybe", 1]]'.encode(), "bad result kind"),
        (f'\n{nonce}[["ok", 1], ["ok", {{"set": [[1]]}}]]'.encode(), "malformed"),
        (f'\n{nonce}{{"ok": 1}}'.encode(), "expected 2 results"),
        (f"\n{nonce}not json".encode(), "malformed"),
    ]:
        with pytest.raises(BadResults, match=why):
            read_results(stdout, nonce, 2)


def test_first_failure_names_the_line_and_the_cause():
    checks = split_asserts("assert f(1) == 1\nassert f(2) == 4\nassert f(3) == 9")
    assert first_failure(checks, [("ok", 1), ("ok", 4), ("ok", 9)]) is None
    assert first_failure(checks, [("ok", 1), ("ok", 5), ("ok", 9)]) == "line 2: assert failed"
    assert first_failure(checks, [("not_plain", "Anything"), ("ok", 4), ("ok", 9)]) == (
        "line 1: f() returned a Anything, not plain data"
    )


def test_code_spec_entry_point_is_an_identifier_that_needs_assert_code():
    assert (
        CodeSpec(assert_code="def check(c):\n    assert c(1)", entry_point="has_close").entry_point
        == "has_close"
    )
    assert CodeSpec(assert_code="assert f(1)").entry_point is None  # optional: older specs are unchanged
    for bad in (
        {"assert_code": "pass", "entry_point": "f(1); g"},
        {"assert_code": "pass", "entry_point": "class"},
    ):
        with pytest.raises(ValidationError, match="identifier"):
            CodeSpec(**bad)
    with pytest.raises(ValidationError, match="entry_point needs assert_code"):
        CodeSpec(tests=[{"stdout": "1"}], entry_point="f")
