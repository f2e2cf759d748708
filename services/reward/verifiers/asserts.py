"""The reward service's side of split asserts: the harness's input line, its result line, and
the judgement of each check. What splits, and how an assert is evaluated on the trusted side,
is `proto/assert_split.py` (its docstring is the spec; the rollout service uses it too, to
refuse a `strict` spec's unsplittable asserts at submission).

Only the calls (a function name and plain-data arguments) go into the sandbox; the results come
back as plain data (`call_harness.py`'s JSON form, decoded with `json.loads` and `decode`,
never `marshal`) and each check's expression is evaluated here. The expected values never
enter the sandbox, so nothing the program does in its own process (an always-true `__eq__`, a
patched `math.isclose` / `builtins.sorted`, `sys.settrace`, a forged result line, an early exit)
can turn a wrong answer into a pass.
"""

from __future__ import annotations

import json
import marshal
from typing import Any

from asyncrl.proto.assert_split import Call, Check, Unsplittable, split_asserts, spread_hashes
from asyncrl.services.reward.verifiers.call_harness import decode

__all__ = [
    "BadResults",
    "Call",
    "Check",
    "Unsplittable",
    "all_calls",
    "calls_line",
    "first_failure",
    "read_results",
    "split_asserts",
]

TYPE_NAME_CHARS = 80  # a type name reported by the sandbox, cut: the program chose it


class BadResults(ValueError):
    """The sandbox's answer is missing or is not a well-formed result line."""


def all_calls(checks: list[Check]) -> list[Call]:
    return [call for check in checks for call in check.calls]


def calls_line(checks: list[Check]) -> str:
    """The harness's input line: the calls, without the expected values (hex of `marshal`,
    which keeps tuples, sets and non-finite floats, and costs the sandbox no import)."""
    return marshal.dumps([(c.func, c.args, dict(c.kwargs)) for c in all_calls(checks)]).hex()


def read_results(stdout: bytes, nonce: str, count: int) -> list[tuple[str, Any]]:
    """`(kind, value)` per call from the harness's result line: `ok` with the decoded result,
    or `not_plain` with a type name. Output of the program around that line is ignored."""
    _, found, tail = stdout.decode(errors="replace").rpartition("\n" + nonce)
    if not found:
        raise BadResults("no result line: the program exited (or crashed silently) before its calls returned")
    try:
        results = json.loads(tail.partition("\n")[0], parse_constant=_refuse)
        if type(results) is not list or len(results) != count:
            raise ValueError(f"expected {count} results")
        out = []
        for kind, value in results:
            if kind == "ok":
                out.append((kind, decode(value, spread_hashes)))
            elif kind == "not_plain" and type(value) is str:
                out.append((kind, value[:TYPE_NAME_CHARS]))
            else:
                raise ValueError(f"bad result kind {str(kind)[:20]!r}")
        return out
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadResults(f"malformed result line: {str(exc)[:200]}") from None


def first_failure(checks: list[Check], results: list[tuple[str, Any]]) -> str | None:
    """Why the first failing check fails (`line N: ...`), or None if all pass. `results`: one
    per call of `all_calls(checks)`, in order."""
    at = 0
    for check in checks:
        mine = results[at : at + len(check.calls)]
        at += len(check.calls)
        for call, (kind, value) in zip(check.calls, mine, strict=True):
            if kind == "not_plain":
                return f"line {check.line}: {call.func}() returned a {value}, not plain data"
        if not check.judge([value for _, value in mine]):
            return f"line {check.line}: assert failed"
    return None


def _refuse(constant: str) -> None:
    raise ValueError(f"bare {constant} in the result line")
