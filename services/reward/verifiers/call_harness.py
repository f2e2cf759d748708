"""The sandbox side of split asserts (`asserts.py`), and the result format both sides share.

This file is shipped verbatim into the sandbox as `main.py` and run there; the reward service
imports it for `decode` only. Standard library only: it runs under the sandbox's interpreter,
and imports nothing costly (`json` would pull in `re`: ~10 ms per run).

Protocol. stdin: a nonce line, then one line of hex: `marshal` of `[(func, args, kwargs), ...]`
(built by the service from literals: plain data only). The harness reads both, points stdin at
/dev/null, execs `solution.py` in a fresh `__main__` scope, calls each function in order and
writes one line to stdout: `<nonce>[["ok", value] | ["not_plain", type name], ...]` in JSON.
An exception in a call propagates: the run fails like any crashing program. Nothing here is
trusted: the program shares this process and can forge that line; it gains nothing by it, since
the line only says what the functions returned and the expected values never enter the sandbox.
The nonce only tells the line apart from the program's own output. The service parses the line
with `json.loads` and `decode`, never with `marshal`.

Plain data, as JSON: None, bool, int, str and finite floats as themselves, lists as arrays;
tuples, sets, frozensets, dicts and non-finite floats as one-key objects `{"tuple": [...]}`,
`{"set": [...]}`, `{"frozenset": [...]}`, `{"dict": [[key, value], ...]}`, `{"float": "inf"}`.
Exact types only, no subclasses: writing a value never runs a method of its own class; except
that a `collections.Counter` or `defaultdict` is written as the plain dict of its entries. Ints
are limited to MAX_INT_BITS.
"""

import math
import sys

try:
    from _json import encode_basestring_ascii as quote  # C, as json.dumps uses
except ImportError:  # an interpreter built without it
    from json import dumps as quote

TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset"}
UNTAG = {"tuple": tuple, "set": set, "frozenset": frozenset}
NON_FINITE = ("inf", "-inf", "nan")
MAX_INT_BITS = 14_000  # ~4200 digits: under Python's default int <-> str limit of 4300 (JSON is text)


class NotPlain(TypeError):
    """A value outside plain data; the message is its type's name."""


def to_json(value) -> str:
    """`value` as JSON text in the tagged form above; NotPlain for anything else."""
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise NotPlain("int of more than 4200 digits")
        return int.__repr__(value)
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else f'{{"float": "{value!r}"}}'
    if kind is str:
        return quote(value)
    if kind is list:
        return "[" + ", ".join(map(to_json, value)) + "]"
    if kind is dict or (issubclass(kind, dict) and kind in _counting_dicts()):
        pairs = dict.items(value)  # the dict's own entries, whatever its class overrides
        return '{"dict": [' + ", ".join(f"[{to_json(k)}, {to_json(v)}]" for k, v in pairs) + "]}"
    if kind in TAGGED:
        return f'{{"{TAGGED[kind]}": [{", ".join(map(to_json, value))}]}}'
    raise NotPlain(kind.__name__)


def _counting_dicts() -> tuple:
    """`Counter` and `defaultdict`, written as the plain dict of their entries: honest solutions
    return them (MBPP's `freq_count`, group-by tasks) for `f(x) == {...}`, which Python compares
    as dicts. Nothing of theirs runs here and no `__eq__` of theirs reaches the service. Taken
    from `sys.modules`: a program that never imported `collections` has none of them."""
    found = sys.modules.get("collections")
    kinds = tuple(getattr(found, name, None) for name in ("Counter", "defaultdict"))
    return tuple(kind for kind in kinds if isinstance(kind, type) and issubclass(kind, dict))


def decode(data, keys):
    """The value of `json.loads(to_json(value))`; ValueError or TypeError on anything `to_json`
    cannot produce. `keys(items)` returns a set's items or a dict's keys as a list after it has
    checked them (the service's `spread_hashes`: n distinct keys of one hash cost n**2 / 2
    comparisons to insert)."""
    kind = type(data)
    if kind is list:
        return [decode(v, keys) for v in data]
    if kind is not dict:
        return data  # JSON scalars (the reader refuses bare NaN / Infinity)
    if len(data) != 1:
        raise ValueError("a tagged value has exactly one key")
    ((tag, items),) = data.items()
    if tag == "float" and items in NON_FINITE:
        return float(items)
    if type(items) is not list or (tag != "dict" and tag not in UNTAG):
        raise ValueError("bad tagged value")
    if tag == "dict":
        pairs = [(decode(k, keys), decode(v, keys)) for k, v in items]
        return dict(zip(keys([k for k, _ in pairs]), [v for _, v in pairs], strict=True))
    values = [decode(v, keys) for v in items]
    return UNTAG[tag](values if tag == "tuple" else keys(values))


def main():
    import builtins
    import marshal
    import os

    nonce = sys.stdin.readline().strip()
    calls = marshal.loads(bytes.fromhex(sys.stdin.readline()))
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the program's stdin for the rest of the run)
    scope = {"__name__": "__main__"}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), scope)  # noqa: S102 (running it is the point)
    results = []
    for func, args, kwargs in calls:
        value = (scope[func] if func in scope else getattr(builtins, func))(*args, **kwargs)
        try:
            results.append(f'["ok", {to_json(value)}]')
        except NotPlain as exc:
            results.append(f'["not_plain", {quote(str(exc))}]')
    sys.stdout.flush()
    data = ("\n" + nonce + "[" + ", ".join(results) + "]\n").encode()
    while data:
        data = data[os.write(1, data) :]


if __name__ == "__main__":
    main()
