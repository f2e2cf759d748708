"""Real suites' `assert_code` begins with imports (`import math`, `from collections import
Counter`) and wraps the call in a builtin (`set(f(x)) == ...`, `sorted(...)`, `len(...)`):
these still split (proto/assert_split.py), so a program that patches `math.isclose`, `math.pi`,
`builtins.set`, `sorted`, `len` or `collections.Counter` in its own process, or returns a result
whose `__eq__` is always true, is paid 0, through the real service (HTTP, bubblewrap). Each
attack also runs once with the same asserts forced into the sandbox (`FORCE_IN_SANDBOX`), where
it is paid 1: the attack is real, the 0 is the split's doing. Honest solutions of such suites
are paid 1 and wrong ones 0. A `strict` spec with an unsplittable test is refused at
`POST /v1/rollouts` (422, the line named) and never reaches the reward service.
"""

from __future__ import annotations

import httpx
import pytest
from rollout_server import serve_in_thread
from test_reward_hacks import FORCE_IN_SANDBOX, score_asserts
from test_sandbox_attacks import assert_host_clean_and_serving

PATCH_ISCLOSE = """
import math
math.isclose = lambda *args, **kwargs: True

def area(r):
    return 0.0
"""

PATCH_PI = """
import math
math.pi = 0.0

def area(r):
    return 0.0
"""

PATCH_SET = """
import builtins
builtins.set = lambda *args: "same"

def common(a, b):
    return [99]
"""

PATCH_SORTED_AND_LEN = """
import builtins
builtins.sorted = lambda *args, **kwargs: [1, 2, 3]
builtins.len = lambda x: 3

def order(xs):
    return [7]
"""

PATCH_COUNTER = """
import collections

class Equal:
    def __eq__(self, other):
        return True

collections.Counter = lambda *args, **kwargs: Equal()

def letters(s):
    return "zzz"
"""

ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__

def root(x):
    return Anything()
"""

ATTACKS = {
    "patched_math_isclose": (
        PATCH_ISCLOSE,
        "import math\n\nassert math.isclose(area(1.0), math.pi, rel_tol=1e-9)",
        "line 3: assert failed",
    ),
    "patched_math_pi": (PATCH_PI, "import math\nassert area(1.0) == math.pi", "line 2: assert failed"),
    "patched_builtins_set": (
        PATCH_SET,
        "import math\nassert set(common([1, 2], [2, 3])) == set([2])",
        "line 2: assert failed",
    ),
    "patched_sorted_and_len": (
        PATCH_SORTED_AND_LEN,
        "import math, collections\nassert sorted(order([3, 1, 2])) == [1, 2, 3]\nassert len(order([1, 2, 3])) == 3",
        "line 2: assert failed",
    ),
    "patched_collections_counter": (
        PATCH_COUNTER,
        "from collections import Counter\nassert Counter(letters('aab')) == Counter({'a': 2, 'b': 1})",
        "line 2: assert failed",
    ),
    "always_equal_with_math_preamble": (
        ALWAYS_EQUAL,
        "import math\nfrom math import sqrt\nassert root(2) == sqrt(2)",
        "line 3: root() returned a Anything, not plain data",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_patching_the_preambles_modules_or_builtins_is_paid_nothing(client, attack):
    program, asserts, why = ATTACKS[attack]
    split, control = score_asserts(
        client, [(program, asserts, {}), (program, FORCE_IN_SANDBOX + asserts, {})]
    )
    assert (split["status"], split["reward"], split["details"]["asserts"]) == ("scored", 0.0, "split"), split
    assert split["details"]["tests"][0]["error"] == why, split
    assert (control["reward"], control["details"]["asserts"]) == (1.0, "in_sandbox"), control
    assert_host_clean_and_serving(client)


SOLUTION = """
import math
from collections import Counter, defaultdict

def freq_count(xs):
    return Counter(xs)

def group_pairs(pairs):
    out = defaultdict(list)
    for key, value in pairs:
        out[key].append(value)
    return out

def similar_elements(a, b):
    return tuple(set(a) & set(b))

def area_circle(r):
    return math.pi * r * r

def char_counts(s):
    return dict(Counter(s))

def split_words(s):
    return s.split()

def mean(xs):
    return sum(xs) / len(xs)

def below_zero(ops):
    total = 0
    for op in ops:
        total += op
        if total < 0:
            return True
    return False
"""
WRONG = """
from collections import Counter, defaultdict

def freq_count(xs):
    return Counter(set(xs))

def group_pairs(pairs):
    return defaultdict(list, {key: [value] for key, value in pairs})
def similar_elements(a, b):
    return (4, 5, 6)

def area_circle(r):
    return 3.0 * r * r

def char_counts(s):
    return {c: 1 for c in s}

def split_words(s):
    return [s]

def mean(xs):
    return sum(xs) / (len(xs) + 1)

def below_zero(ops):
    return False
"""
SUITES = [
    "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
    "import math\nassert math.isclose(area_circle(2), 12.566370614359172, rel_tol=0.001)",
    "import math\nassert abs(area_circle(1.0) - math.pi) < 1e-9",
    "from math import pi\nassert round(area_circle(2), 2) == round(4 * pi, 2)",
    "from collections import Counter\nassert Counter(char_counts('aab')) == Counter({'a': 2, 'b': 1})",
    "import re, string\nassert sorted(split_words('b a c')) == list(string.ascii_lowercase[:3])",
    "assert len(split_words('x y')) == 2 and split_words('x y')[0] == 'x'",
    "from typing import List\nimport math\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 2, -4, 5]) is True\n    assert not candidate([1, 2, -3, 1, 2, -3])\n",
    "import statistics\nassert 1.9 < mean([1, 2, 3]) <= 2.0",
    "for s, n in [('a b', 2), ('x', 1)]:\n    assert len(split_words(s)) == n",
    "result = similar_elements((1, 2), (2, 3))\nassert result == (2,)\nassert len(result) == 1",
    # a Counter / defaultdict returned, compared with a dict literal (MBPP's freq_count)
    "assert freq_count([10, 10, 20, 10]) == {10: 3, 20: 1}",
    "assert group_pairs([('y', 1), ('b', 2), ('y', 3)]) == {'y': [1, 3], 'b': [2]}",
]
SPECS = [{"entry_point": "below_zero"} if "def check" in suite else {} for suite in SUITES]


def test_honest_solutions_of_suites_with_preambles_are_paid_and_wrong_ones_are_not(client):
    items = [(program, suite, spec) for program in (SOLUTION, WRONG) for suite, spec in zip(SUITES, SPECS)]
    results = score_asserts(client, items)
    got = [(r["reward"], r["details"]["asserts"]) for r in results]
    assert got == [(1.0, "split")] * len(SUITES) + [(0.0, "split")] * len(SUITES), results


def test_a_strict_spec_refuses_unsplittable_asserts_at_rollout_submission(
    client, reward_url, redis_url, run_id, tiny
):
    from transformers import AutoTokenizer

    # The rollout checks specs with the reward service's published schemas: the code verifier
    # of the real service here (bubblewrap) serves `strict`. No engine is reached: the spec is
    # refused first (the engine URL is a closed port).
    rollout = serve_in_thread(
        redis_url,
        loaded_tokenizer=AutoTokenizer.from_pretrained(str(tiny)),
        run=run_id,
        replica="r0",
        engine_urls="http://127.0.0.1:9",
        reward_url=reward_url,
        tokenizer=str(tiny),
    )
    loop = "import math\ncases = [(1, 2)]\nwhile cases:\n    assert add(*cases.pop()) == 3"
    try:
        with httpx.Client(base_url=rollout.url, timeout=30) as http:
            for asserts, where in [
                (loop, "line 3: unsupported statement `while cases:`"),
                ("import os\nassert add(1, 2) == 3", "line 1: import of `os`"),
            ]:
                spec = {"verifier": "code", "assert_code": asserts, "strict": True}
                reply = http.post("/v1/rollouts", json={"prompts": [{"text": "add>"}], "reward_spec": spec})
                assert reply.status_code == 422, reply.text
                detail = reply.json()["detail"]
                assert detail.startswith("invalid reward_spec: reward_spec.spec: Value error, strict:"), (
                    detail
                )
                assert where in detail, detail
            # the same loop without strict is accepted (it will run in the sandbox, reported)
            loose = {"verifier": "code", "assert_code": loop}
            reply = http.post("/v1/rollouts", json={"prompts": [{"text": "add>"}], "reward_spec": loose})
            assert reply.status_code == 202, reply.text
    finally:
        rollout.stop()
    # the reward service refuses the strict spec too, for a caller that skips the rollout
    body = {
        "items": [
            {
                "id": "0",
                "completion": "def add(a, b):\n    return a + b",
                "spec": {"verifier": "code", "assert_code": loop, "strict": True},
            }
        ]
    }
    reply = client.post("/v1/rewards", json=body)
    assert reply.status_code == 422 and "line 3: unsupported statement" in reply.text, reply.text
