"""Programs that game `assert_code` instead of solving it, through the real service (HTTP,
bubblewrap). Split asserts (calls in the sandbox, comparisons in the service) must pay each of
them 0. Each attack is also run once against the same asserts forced onto the in-sandbox path
(an unsupported first line), where it is paid 1: that proves the attack is real, so the 0 on
the split path is the split's doing, and it pins down why `asserts: "in_sandbox"` is a warning.
"""

from __future__ import annotations

import re
import uuid

import pytest
from test_sandbox_attacks import assert_host_clean_and_serving

FORCE_IN_SANDBOX = "import os  # never evaluated by the split: the asserts run next to the program\n"


def score_asserts(client, items: list[tuple[str, str, dict]]) -> list[dict]:
    """Score (program, assert_code, extra spec) items in one request, in order."""
    body = {
        "items": [
            {
                "id": str(i),
                "completion": f"```python\n{program}\n```",
                "spec": {"verifier": "code", "assert_code": asserts, "timeout_s": 3, **extra},
            }
            for i, (program, asserts, extra) in enumerate(items)
        ]
    }
    reply = client.post("/v1/rewards", json=body)
    assert reply.status_code == 200, reply.text
    return sorted(reply.json()["results"], key=lambda r: int(r["id"]))


ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__

def add(a, b):
    return Anything()
"""

PATCHED_ISCLOSE = """
import sys, types
fake = types.ModuleType("math")
fake.isclose = lambda *args, **kwargs: True
sys.modules["math"] = fake

def area(r):
    return 0.0
"""

# Reads the harness to learn where the sentinel is, takes it from the harness's frame, prints
# it as the last line and leaves before any assert runs.
SENTINEL = """
import os, sys
harness = open("/work/main.py").read()
name = "token" if "token" in harness else "nonce"
frame = sys._getframe(1)
while frame is not None and name not in frame.f_locals:
    frame = frame.f_back
if frame is not None:
    sys.stdout.write("\\n" + frame.f_locals[name] + "\\n")
    sys.stdout.flush()
os._exit(0)
"""

# A trace hook on the harness's frames jumps over the line that runs the asserts (or makes
# the calls, on the split path).
SETTRACE = """
import sys
harness = open("/work/main.py").read().splitlines()

def skip(frame, event, arg):
    if event == "line" and frame.f_code.co_filename in ("<string>", "/work/main.py"):
        text = harness[frame.f_lineno - 1]
        if ('"tests.py"' in text and "exec" in text) or "(*args, **kwargs)" in text:
            frame.f_lineno += 1
    return skip

frame = sys._getframe(1)
while frame is not None:
    frame.f_trace, frame.f_trace_lines = skip, True
    frame = frame.f_back
sys.settrace(skip)

def add(a, b):
    return a - b
"""

NOT_PLAIN = """
def is_prime(n):
    return object()  # truthy, and not a bool
"""

ATTACKS = {
    "always_equal": (ALWAYS_EQUAL, "assert add(2, 2) == 5", "returned a Anything, not plain data"),
    "patched_isclose": (
        PATCHED_ISCLOSE,
        "import math\nassert math.isclose(area(1.0), 3.14159, rel_tol=1e-4)",
        "line 2: assert failed",
    ),
    "sentinel_then_exit": (SENTINEL, "assert add(2, 2) == 5", "result line"),
    "settrace_skips_asserts": (SETTRACE, "assert add(2, 2) == 4\nassert add(1, 1) == 2", "UnboundLocalError"),
    "not_plain_result": (NOT_PLAIN, "assert is_prime(7)\nassert is_prime(13)", "returned a object"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_assert_hacks_score_zero_on_split_asserts(client, attack):
    program, asserts, why = ATTACKS[attack]
    split, control = score_asserts(
        client, [(program, asserts, {}), (program, FORCE_IN_SANDBOX + asserts, {})]
    )
    assert (split["status"], split["reward"], split["details"]["asserts"]) == ("scored", 0.0, "split"), split
    test = split["details"]["tests"][0]
    assert why in test.get("error", "") + test.get("stderr_tail", ""), split
    assert (control["reward"], control["details"]["asserts"]) == (1.0, "in_sandbox"), control
    assert_host_clean_and_serving(client)


def test_expected_values_never_enter_the_sandbox(client):
    # The program searches everything it can read (its stdin, the harness's memory, the files
    # of the run) for the expected value and returns it: found, it would pass.
    expected = f"EXPECTED-{uuid.uuid4().hex}"
    program = """
import gc, os, re, sys

def scan():
    needle, seen = re.compile("EXPEC" + "TED-[0-9a-f]{32}"), []
    for obj in gc.get_objects():
        seen += obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    frame = sys._getframe()
    while frame is not None:
        seen += frame.f_locals.values()
        frame = frame.f_back
    seen += [open("/work/" + name, errors="ignore").read() for name in os.listdir("/work")]
    hits = [hit for s in seen if isinstance(s, str) for hit in needle.findall(s)]
    return hits[0] if hits else "not found"

FOUND = scan()

def secret():
    return FOUND
"""
    asserts = f"assert secret() == {expected!r}"
    split, control = score_asserts(
        client, [(program, asserts, {}), (program, FORCE_IN_SANDBOX + asserts, {})]
    )
    assert (split["reward"], split["details"]["asserts"]) == (0.0, "split"), split
    assert (control["reward"], control["details"]["asserts"]) == (1.0, "in_sandbox"), control
    assert_host_clean_and_serving(client)


def test_forged_result_lines_and_output_junk_cannot_pass_a_wrong_answer(client):
    # The program finds the nonce and writes a result line of its own, then junk, then exits:
    # the line says what it "returned", which is the wrong answer it would have returned anyway.
    forger = """
import json, os, sys
frame = sys._getframe(1)
while "nonce" not in frame.f_locals:
    frame = frame.f_back
nonce = frame.f_locals["nonce"]
sys.stdout.write("\\n" + nonce + json.dumps([["ok", 5], ["ok", 5]]) + "\\ntrailing junk")
sys.stdout.flush()
os._exit(0)

def add(a, b):
    return 5
"""
    honest_noisy = """
import atexit
print("[[\\"ok\\", 5]]")
atexit.register(print, "junk after the harness")

def add(a, b):
    print("debug", a, b, end="")
    return a + b
"""
    asserts = "assert add(2, 2) == 4\nassert add(1, 2) == 3"
    forged, noisy = score_asserts(client, [(forger, asserts, {}), (honest_noisy, asserts, {})])
    assert (forged["reward"], forged["details"]["tests"][0]["error"]) == (0.0, "line 1: assert failed"), (
        forged
    )
    assert (noisy["reward"], noisy["details"]["asserts"]) == (1.0, "split"), noisy


CORRECT = """
import math

def add(a, b):
    return a + b

def mean(xs):
    return sum(xs) / len(xs)

def evens(xs):
    return [x for x in xs if x % 2 == 0]

def is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))

def find(xs, x):
    return xs.index(x) if x in xs else None

def stats(xs):
    return (min(xs), max(xs)), {x: xs.count(x) for x in set(xs)}, set(xs)

def inverse(x):
    return 1 / x if x else float("inf")
"""
WRONG = """
def add(a, b):
    return a + b + 1

def mean(xs):
    return sum(xs) / (len(xs) + 1)

def evens(xs):
    return xs

def is_prime(n):
    return n % 4 == 0

def find(xs, x):
    return xs.index(x) + 1 if x in xs else -1

def stats(xs):
    return [min(xs), max(xs)], {x: xs.count(x) for x in set(xs)}, set(xs)  # a list, not the tuple

def inverse(x):
    return x if x else float("inf")
"""
FORMS = [
    "assert add(2, 3) == 5",
    "assert 5 == add(2, 3)",
    "assert add(2, 2) != 5",
    "assert add(-1, -2) <= -3",
    "assert abs(mean([1, 2, 2]) - 1.6667) < 1e-3",
    "assert abs(1.6667 - mean([1, 2, 2])) <= 1e-3",
    "import math\nassert math.isclose(mean([0.1, 0.2]), 0.15, rel_tol=1e-9, abs_tol=0.0)",
    "from math import isclose\nassert isclose(0.15, mean([0.1, 0.2]))",
    "assert is_prime(7)",
    "assert not is_prime(8)",
    "assert is_prime(2) is True",
    "assert find([1, 2], 3) is None",
    "assert find([5, 6], 6) in [1, 7]",
    "assert evens([1, 2, 3, 4]) == [2, 4] and evens([]) == []",
    "assert stats([1, 1, 2]) == ((1, 2), {1: 2, 2: 1}, {1, 2})",
    "assert inverse(0) == float('inf')\nassert inverse(x=4) == 0.25",
    "N = 10**9 + 7\nassert add(N, -7) == 10**9",
]


def test_correct_solutions_pass_and_wrong_ones_fail_with_each_supported_form(client):
    results = score_asserts(client, [(program, form, {}) for program in (CORRECT, WRONG) for form in FORMS])
    got = [
        (r["status"], r["reward"], r["details"]["asserts"], r["details"]["tests"][0]["status"])
        for r in results
    ]
    right, wrong = got[: len(FORMS)], got[len(FORMS) :]
    assert dict(zip(FORMS, right, strict=True)) == dict.fromkeys(FORMS, ("scored", 1.0, "split", "passed"))
    assert dict(zip(FORMS, wrong, strict=True)) == dict.fromkeys(FORMS, ("scored", 0.0, "split", "failed"))
    split_items = re.search(
        r'asyncrl_reward_code_assert_items_total\{mode="split"\} ([0-9.]+)', client.get("/metrics").text
    )
    assert split_items and float(split_items.group(1)) >= 2 * len(FORMS)


def test_humaneval_check_candidate(client):
    check = (
        "METADATA = {'author': 'jt', 'dataset': 'test'}\n\n"
        "def check(candidate):\n"
        "    assert candidate([1.0, 2.0, 3.9], 0.3) == False\n"
        "    assert candidate([1.0, 2.8, 3.0], 0.3) == True\n"
        "    assert True, 'This prints if this assert fails'\n"
    )
    solution = (
        "def has_close_elements(numbers, threshold):\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n"
    )
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    called = check + "\ncheck(has_close_elements)\n"
    spec = {"entry_point": "has_close_elements"}
    results = score_asserts(
        client,
        [(solution, called, {}), (solution, check, spec), (wrong, called, {}), (wrong, check, spec)],
    )
    assert [(r["reward"], r["details"]["asserts"]) for r in results] == [
        (1.0, "split"),
        (1.0, "split"),
        (0.0, "split"),
        (0.0, "split"),
    ], results
    assert results[0]["details"]["tests"][0]["checked"] == 2


def test_unsplittable_asserts_still_run_in_the_sandbox_and_say_so(client):
    asserts = "cases = [(1, 2), (3, 4)]\nwhile cases:\n    a, b = cases.pop()\n    assert add(a, b) == a + b"
    check = "def check(f):\n    assert all(x >= 0 for x in [f(1, 0)]) and f(1, 0) == 1"
    honest, wrong = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"
    results = score_asserts(
        client,
        [
            (program, code, spec)
            for code, spec in ((asserts, {}), (check, {"entry_point": "add"}))
            for program in (honest, wrong)
        ],
    )
    assert [(r["reward"], r["details"]["asserts"], r["details"]["tests"][0]["status"]) for r in results] == [
        (1.0, "in_sandbox", "passed"),
        (0.0, "in_sandbox", "failed"),
        (1.0, "in_sandbox", "passed"),
        (0.0, "in_sandbox", "failed"),  # check(add) was run: the entry point is appended
    ], results
    assert results[0]["details"]["unsplittable"] == "line 2: unsupported statement `while cases:`"
