"""Split `assert_code` into calls made in the sandbox and a test judged by the reward service.

An assert run next to the program it tests can be gamed by that program: a result whose
`__eq__` is always true, a `math.isclose` or `builtins.sorted` patched in its process, a forged
end-of-run sentinel, a `sys.settrace` hook that jumps over the asserts. So the trusted side
parses the asserts with `ast`; only the calls of the program's functions (a name and plain-data
arguments) enter the sandbox (`call_harness.py`), their results come back as plain data, and
each assert's expression is evaluated here around them by a small interpreter that knows only
the operations below, each the service's own builtin or standard-library function (nothing is
looked up in anything the program controls, nothing is imported at split time). The expected
values never enter the sandbox. This module is in proto/ because the rollout service refuses
unsplittable asserts of a `strict` code spec at submission with it (`proto/verifiers.py`).

Statements, each at module level or in the body of a one-parameter function such as
HumanEval's `def check(candidate)` that is then called as `check(name)` (or named by the spec's
`entry_point`), with the parameter standing for that name:
* `assert <expression>` (an `and` at the top is split into one check per operand, so a
  failure names its line); its message is never evaluated;
* imports of the standard modules in `MODULES` (`import math`, `import math as m`,
  `from collections import Counter, deque`, `from typing import List`, `import re, string`);
  they bind only the names listed there, read from the service's own modules. Names of them
  not listed (`re.match`: unbounded backtracking on the program's output; `typing.List`;
  `itertools.*`) make an assert that uses them unsplittable, not the import;
* docstrings, `pass`, and `NAME = <expression>` (a tuple of names too, when the expression
  calls no function of the program), which binds NAME for the later asserts only (the program
  does not see it). `result = f(1)` then `assert result == 2`: each assert that uses the name
  makes its calls again (once per assert), in the sandbox;
* `for TARGET in <expression without calls of the program>:` of supported statements, no
  `else`: unrolled here, its body once per item with TARGET bound to it (at most MAX_UNROLLED
  iterations in all, `range()` of at most MAX_RANGE numbers, and at most MAX_UNROLLED_NODES
  AST nodes compiled again: iterations times the body's size).
Static values are charged by size each time an operation or a call uses them, at most MAX_WORK
in all: a large value named once and used in every unrolled assert is refused, not computed.

Expressions: literals (None, bool, int, float, str; tuple, list, set and dict displays of
expressions), names bound above, builtin type names (`int`, `str`, ...), `-x +x ~x not x`,
`+ - * / // % **` of numbers only (ints of at most MAX_INT_BITS bits, `**` exponents of at most
MAX_POW_EXPONENT), comparisons (chains included; `is` / `is not` only with None, True, False or
a type), `and` / `or` (lazy, as Python's), `x[i]` and `x[a:b:c]`, list, set, dict and
generator comprehensions whose iterables and `if`s are known here (unrolled like `for`:
`all(f(x) == x * x for x in range(9))` is nine calls), calls of
* the program: a plain name that is none of the names below, or the `check` parameter, with
  arguments computed here to plain data (literals, `math.sqrt(2)`, `string.digits`, ...);
  a call of the program inside another call's arguments is unsplittable (it would need its
  result in the sandbox), and so is a call of a capitalised name (`Point(1, 2)`,
  `Solution()`: a class, whose instances are never plain data);
* the builtins in `BUILTINS` (`len set sorted round str int`, ...: `set(f(x)) == {1, 2}`,
  `sorted(f(x), key=len)`, `round(f(x), 2) == 1.23`, `abs(f(x) - y) < eps`, `isinstance`),
  the functions of `MODULES` (`math.isclose`, `math.sqrt`, `Counter(f(x))`, `Fraction(1, 3)`),
  and the methods
  in `METHODS` of a str, dict, list or tuple value (`f(x).lower()`, `f(x).split()`; another
  method name, `Solution().twoSum(...)`, is unsplittable); each has
  bounds on its arguments where its cost depends on them (`math.factorial(n)`, n <= 1000).
A builtin called with arguments that involve no call of the program is computed here at split
time, except when its name is the spec's `entry_point`. An assert whose expression calls no
function of the program is unsplittable (unless it is a true constant: skipped), because the
program may define that name (`def max(...)`) and the asserts, run as written, would test it.

Anything else makes the whole `assert_code` unsplittable (`Unsplittable` says which line and
why): other statements (`while`, `if`, `f(x)` alone, `sys.setrecursionlimit`), a result of
the program as an argument (`g(f(1))`, `r = f(1); g(r)`), imports of other modules
(`os`, `subprocess`, `builtins`, `importlib`, `numpy`...), comprehensions over a result of the
program (`all(x > 0 for x in f(1))`) and `range()` of one, lambdas, bytes,
complex numbers, attributes of values, arguments that are not plain data (a `Fraction`). The
code verifier then runs it as written, inside the sandbox, and says so; a `strict` spec is
refused instead.

Differences from running the asserts in the program's process: every call runs, even after a
failed assert or inside a short-circuited `and` / `or`, and a call bound to a name runs once
per assert that uses it, never if none does (the first failing check decides; a
call that raises or hangs makes the run a runtime error or timeout, reward 0 all the same);
names bound by `assert_code` (its imports too) are not visible to the program; a result that
is not plain data (a class instance, a generator, a subclass of a plain type other than a
`Counter` or `defaultdict`, which come back as dicts, an int of more
than ~4200 digits) fails, and so does an operation that raises here (`sorted` of mixed types),
or a set or dict (a result, or built here: `set(f(x))`) with more than MAX_SAME_HASH distinct
keys of one hash (`spread_hashes`: their insertion would cost quadratic time here).
Results compare as Python values: a tuple stays a tuple (`f() == (1, 2)` fails for a list).
"""

from __future__ import annotations

import ast
import collections
import decimal
import fractions
import math
import operator
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_INT_BITS = 14_000  # ints in arithmetic: what the harness lets a result be (~4200 digits)
MAX_POW_EXPONENT = 64  # `x ** n`, and its int result at most MAX_INT_BITS: never a costly power
MAX_ROUND_DIGITS = 100  # round(x, n): |n| above this only spends time on 10**n
MAX_FACTORIAL = 1000  # math.factorial(1000) is ~8500 bits
MAX_COMB = 1000  # math.comb / perm n: comb(1000, 500) is ~1000 bits, microseconds
MAX_NUMBER_TEXT = 100  # Fraction / Decimal from a string: bounded parse, bounded exponent
MAX_DECIMAL_EXPONENT = 1000  # comparing Decimal('1e999999999') with a Fraction builds 10**that
MAX_UNROLLED = 5000  # loop iterations unrolled into checks, per assert_code: ~1 s of parsing at most
MAX_UNROLLED_NODES = 100_000  # AST nodes compiled again by unrolling (iterations x body size)
MAX_RANGE = 100_000  # range() lengths: `list(range(10**9))` would be built here
MAX_WORK = 5_000_000  # items of static values used by operations, all asserts: ~a second at most
MAX_SAME_HASH = 16  # distinct keys of one hash in a set or dict built here (hash(-1) == hash(-2))


class Unsplittable(ValueError):
    """`assert_code` outside the supported forms; the message says where and why."""


@dataclass(frozen=True)
class Call:
    """One call of the program's function `func`, made in the sandbox (plain-data arguments)."""

    func: str
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, eq=False)
class Check:
    """One assert: its `calls` are made in the sandbox, `test` maps their results (in order)
    to the assert's value here. `source` is the assert's expression, for reports."""

    line: int
    calls: tuple[Call, ...]
    test: Callable[[list], Any]
    source: str = ""

    def judge(self, results: list) -> bool:
        """Whether the results (plain data) pass; an operation that raises fails."""
        try:
            return bool(self.test(results))
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError):
            return False


def split_asserts(source: str, entry_point: str | None = None) -> list[Check]:
    """The checks of `source` in order; `entry_point`: also run `check(entry_point)` after it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise Unsplittable(f"does not parse: {exc}") from None
    splitter = _Splitter(entry_point)
    try:
        checks = splitter.module(tree.body)
        if entry_point is not None:
            if "check" not in splitter.helpers:
                raise Unsplittable("entry_point given but no `def check(candidate)`")
            checks += splitter.expand("check", entry_point)
    except RecursionError:
        raise Unsplittable("expressions nested too deeply") from None
    if not checks:
        raise Unsplittable("no assert is run")
    return checks


# ---- what the interpreter knows: each a function of the service's own, with its bounds ----


class Opaque:
    """A name an import binds that the trusted side does not evaluate (`typing.List`, `re.match`)."""

    def __init__(self, name: str, why: str = "not evaluated by the trusted side"):
        self.name, self.why = name, why


def _guard_int(*values: Any) -> None:
    for value in values:
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise ValueError(f"an int of more than {MAX_INT_BITS} bits")


def _numbers(*values: Any) -> None:
    for value in values:
        if type(value) not in (bool, int, float):
            raise TypeError(f"arithmetic on a {type(value).__name__}")
    _guard_int(*values)


def _arith(fn: Callable) -> Callable:
    def apply(a: Any, b: Any) -> Any:
        _numbers(a, b)
        return fn(a, b)

    return apply


def _power(base: Any, exponent: Any) -> Any:
    _numbers(base, exponent)
    if type(exponent) is not float and abs(exponent) > MAX_POW_EXPONENT:
        raise ValueError(f"`**` with an exponent above {MAX_POW_EXPONENT}")
    if type(base) is int and type(exponent) is not float and base.bit_length() * exponent > MAX_INT_BITS:
        raise ValueError(f"`**` with a result above {MAX_INT_BITS} bits")
    return operator.pow(base, exponent)


def _unary(fn: Callable) -> Callable:
    def apply(a: Any) -> Any:
        _numbers(a)
        return fn(a)

    return apply


def _bounded(fn: Callable, limit: int, what: str) -> Callable:
    """`fn` whose int arguments are at most `limit` (their cost grows with them)."""

    def apply(*args: Any) -> Any:
        if any(type(a) is int and a > limit for a in args):
            raise ValueError(f"{what} above {limit}")
        _guard_int(*args)
        return fn(*args)

    return apply


def _ints(fn: Callable) -> Callable:
    def apply(*args: Any) -> Any:
        _guard_int(*args)
        return fn(*args)

    return apply


def spread_hashes(items: Any) -> list:
    """`items` as a list, refused (ValueError) if more than MAX_SAME_HASH distinct ones share a
    hash: a set or dict of n ints `k * (2**61 - 1)` (all of hash 0) costs n**2 / 2 comparisons
    to build (20k of them, 0.5 MB of a result line: ~10 s of the service's event loop)."""
    items = list(items)
    groups: dict[int, list] = {}  # keyed by hash values: ints that are their own distinct hashes
    for item in items:
        same = groups.setdefault(hash(item), [])
        if item not in same:
            if len(same) >= MAX_SAME_HASH:
                raise ValueError(f"more than {MAX_SAME_HASH} distinct keys of one hash")
            same.append(item)
    return items


def _keyed(kind: type) -> Callable:
    """`kind` (a set or dict type) whose keys from a sequence are checked by `spread_hashes`
    first; a mapping or set argument was itself built by a checked constructor or a literal."""

    def build(*args: Any) -> Any:
        if not args or isinstance(args[0], dict | set | frozenset):
            return kind(*args)
        items = list(args[0])
        if issubclass(kind, dict) and kind is not collections.Counter:
            items = [tuple(pair) for pair in items]
            if any(len(pair) != 2 for pair in items):
                raise ValueError(f"{kind.__name__}() of items that are not pairs")
            spread_hashes(key for key, _ in items)
        else:
            spread_hashes(items)
        return kind(items, *args[1:])

    return build


def _dict_of(*kv: Any) -> dict:
    """A dict display's or comprehension's value from its keys and values, interleaved."""
    return dict(zip(spread_hashes(kv[::2]), kv[1::2], strict=True))


def _sum(values: Any) -> Any:
    """sum() of numbers only: `sum(lists, [])` would copy quadratically in the service."""
    items = list(values)
    _numbers(*items)
    return sum(items)


def _range(*args: Any) -> range:
    _guard_int(*args)
    value = range(*args)
    if len(value) > MAX_RANGE:
        raise ValueError(f"range of more than {MAX_RANGE} numbers")
    return value


def _round(number: Any, ndigits: Any = None) -> Any:
    if ndigits is not None and (type(ndigits) is not int or abs(ndigits) > MAX_ROUND_DIGITS):
        raise ValueError(f"round() digits beyond ±{MAX_ROUND_DIGITS}")
    return round(number, ndigits)


def _text_number(kind: type) -> Callable:
    def build(*args: Any) -> Any:
        for arg in args:
            if type(arg) not in (int, str) or (type(arg) is str and len(arg) > MAX_NUMBER_TEXT):
                raise ValueError(f"{kind.__name__}() of an int or a short string only")
        _guard_int(*args)
        value = kind(*args)
        if kind is decimal.Decimal and value.is_finite() and abs(value.adjusted()) > MAX_DECIMAL_EXPONENT:
            raise ValueError(f"Decimal exponent beyond ±{MAX_DECIMAL_EXPONENT}")
        return value

    return build


TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset)}
KEY_FUNCS = {len, abs, str, int, float, tuple, sorted, *TYPES.values()}  # `key=` of sorted/min/max


@dataclass(frozen=True)
class Func:
    """A trusted function: the callable, and the keyword names it may be given."""

    fn: Callable
    keywords: frozenset = frozenset()


def _f(fn: Callable, *keywords: str) -> Func:
    return Func(fn, frozenset(keywords))


BUILTINS: dict[str, Func] = {
    "abs": _f(abs),
    "len": _f(len),
    "round": _f(_round, "ndigits"),
    "sorted": _f(sorted, "key", "reverse"),
    "min": _f(min, "key", "default"),
    "max": _f(max, "key", "default"),
    "sum": _f(_sum),
    "all": _f(all),
    "any": _f(any),
    "bool": _f(bool),
    "str": _f(str),
    "int": _f(_ints(int)),
    "float": _f(float),
    "list": _f(list),
    "tuple": _f(tuple),
    "set": _f(_keyed(set)),
    "frozenset": _f(_keyed(frozenset)),
    "dict": _f(_keyed(dict)),
    "isinstance": _f(isinstance),
    "type": _f(type),
    "range": _f(lambda *args: _range(*args)),
}
_MATH_FUNCS = {
    "isclose": _f(math.isclose, "rel_tol", "abs_tol"),
    "factorial": _f(_bounded(math.factorial, MAX_FACTORIAL, "factorial")),
    "comb": _f(_bounded(math.comb, MAX_COMB, "comb")),
    "perm": _f(_bounded(math.perm, MAX_COMB, "perm")),
    **{
        name: _f(_ints(getattr(math, name)))
        for name in [
            "sqrt",
            "isqrt",
            "floor",
            "ceil",
            "trunc",
            "fabs",
            "gcd",
            "lcm",
            "log",
            "log2",
            "log10",
            "exp",
            "sin",
            "cos",
            "tan",
            "asin",
            "acos",
            "atan",
            "atan2",
            "hypot",
            "degrees",
            "radians",
            "isnan",
            "isinf",
            "isfinite",
            "copysign",
            "fsum",
            "pow",
        ]
    },
}
_COLLECTIONS = {
    "Counter": _f(_keyed(collections.Counter)),
    "OrderedDict": _f(_keyed(collections.OrderedDict)),
    "deque": _f(collections.deque),
    "defaultdict": Opaque("collections.defaultdict", "a factory, not a value"),
    "namedtuple": Opaque("collections.namedtuple", "defines a class"),
}
# The standard modules whose import a split accepts, and the names of each it evaluates.
# A module not here is never imported on any side by the split; one here binds only this table.
MODULES: dict[str, dict[str, Any]] = {
    "math": {
        **{name: getattr(math, name) for name in ("pi", "e", "tau", "inf", "nan")},
        **_MATH_FUNCS,
    },
    "string": {
        name: getattr(string, name)
        for name in [
            "ascii_lowercase",
            "ascii_uppercase",
            "ascii_letters",
            "digits",
            "hexdigits",
            "octdigits",
            "punctuation",
            "whitespace",
            "printable",
        ]
    },
    "sys": {
        "maxsize": sys.maxsize,
        "maxunicode": sys.maxunicode,
        "float_info": {n: getattr(sys.float_info, n) for n in ("max", "min", "epsilon", "dig")},
    },
    "collections": _COLLECTIONS,
    "fractions": {"Fraction": _f(_text_number(fractions.Fraction))},
    "decimal": {"Decimal": _f(_text_number(decimal.Decimal))},
    # Accepted so real suites' preambles split; none of their names is evaluated here.
    "typing": {},
    "re": {},  # patterns on the program's output could backtrack without bound in the service
    "itertools": {},
    "functools": {},
    "heapq": {},
    "random": {},
    "copy": {},
    "operator": {},
    "bisect": {},
    "statistics": {},
}
METHODS: dict[type, frozenset[str]] = {
    str: frozenset(
        [
            "lower",
            "upper",
            "strip",
            "lstrip",
            "rstrip",
            "split",
            "rsplit",
            "splitlines",
            "startswith",
            "endswith",
            "count",
            "find",
            "rfind",
            "isdigit",
            "isalpha",
            "isalnum",
            "isspace",
            "isupper",
            "islower",
            "istitle",
            "title",
            "capitalize",
            "casefold",
            "swapcase",
        ]
    ),
    dict: frozenset({"keys", "values", "items", "get"}),
    list: frozenset({"count", "index"}),
    tuple: frozenset({"count", "index"}),
}
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
BINARY = {
    ast.Add: _arith(operator.add),
    ast.Sub: _arith(operator.sub),
    ast.Mult: _arith(operator.mul),
    ast.Div: _arith(operator.truediv),
    ast.FloorDiv: _arith(operator.floordiv),
    ast.Mod: _arith(operator.mod),
    ast.Pow: _power,
}
UNARY = {
    ast.USub: _unary(operator.neg),
    ast.UAdd: _unary(operator.pos),
    ast.Invert: _unary(operator.invert),
    ast.Not: operator.not_,
}
IDENTITY_OK = (None, True, False, *TYPES.values())  # what `is` may compare with: singletons
PLAIN_SCALARS = (type(None), bool, int, float, str)


def is_plain(value: Any) -> bool:
    """Whether `value` is plain data (exact types), what may cross into the sandbox."""
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return kind is not int or value.bit_length() <= MAX_INT_BITS
    if kind in (list, tuple, set, frozenset):
        return all(is_plain(v) for v in value)
    if kind is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


# ---- the splitter: statements to checks, expressions to static values or functions ----


CONTAINERS = (
    list,
    tuple,
    set,
    frozenset,
    collections.deque,
    *(type(view) for view in ({}.keys(), {}.values(), {}.items())),
)


class Static:
    """An expression's value known at split time (no call of the program in it)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


Node = Static | Callable[[list], Any]  # a static value, or a function of the calls' results


def _value(node: Node, results: list) -> Any:
    return node.value if isinstance(node, Static) else node(results)


def _module_entry(module: str, attr: str) -> Any:
    table = MODULES[module]
    if attr not in table:
        return Opaque(f"{module}.{attr}")
    return table[attr]


class Deferred:
    """`NAME = <expression that calls the program>`: each assert that uses NAME makes the calls
    again (in the sandbox) and evaluates the expression on its own results."""

    def __init__(self, node: Callable[[list], Any], calls: tuple[Call, ...], work: int):
        self.node, self.calls, self.work = node, calls, work  # work: charged again per use
        self.last: tuple[list[Call], Callable[[list], Any]] | None = None  # its use in one assert

    def use(self, calls: list[Call]) -> Callable[[list], Any]:
        """The expression as a node of the assert whose calls are `calls` (appended to, once
        per assert: `r[0] == r[-1]` calls once)."""
        if self.last is not None and self.last[0] is calls:
            return self.last[1]
        start, node = len(calls), self.node
        calls.extend(self.calls)
        end = len(calls)
        used = self.last = (calls, lambda results: node(results[start:end]))
        return used[1]


class _Splitter:
    def __init__(self, entry_point: str | None):
        self.entry_point = entry_point
        self.names: dict[str, Any] = {"math": MODULES["math"]}  # `math` may be the program's import
        self.modules: set[int] = {id(MODULES["math"])}
        self.helpers: dict[str, ast.FunctionDef] = {}  # one-parameter functions of asserts
        self.calls: list[Call] = []  # of the assert being compiled
        self.unrolled = 0  # loop iterations so far, all loops together
        self.unrolled_nodes = 0  # iterations x the size of what each compiles, all loops together
        self.work = 0  # sizes of the static values operations used so far (`charge`)
        self.weights: dict[int, tuple[Any, int]] = {}

    def module(self, body: list[ast.stmt]) -> list[Check]:
        checks = []
        for stmt in body:
            match stmt:
                case ast.FunctionDef(name=name, args=args, decorator_list=[]) if _one_parameter(args):
                    self.helpers[name] = stmt
                case ast.Expr(value=ast.Call(func=ast.Name(id=name), args=[ast.Name(id=target)])) if (
                    name in self.helpers and not stmt.value.keywords
                ):
                    checks += self.expand(name, target)
                case _:
                    checks += self.statement(stmt, {})
        return checks

    def compile_setup(self, stmt: ast.stmt, value: ast.expr, alias: dict[str, str]) -> Static:
        """The value of `value`, which may not call the program (it is computed here)."""
        self.calls = []
        try:
            node = self.expr(value, alias)
        except Unsplittable as exc:
            raise Unsplittable(f"line {stmt.lineno}: setup `{_show(stmt)}` ({_reason(exc)})") from None
        if not isinstance(node, Static) or self.calls:
            raise Unsplittable(f"line {stmt.lineno}: setup `{_show(stmt)}` calls the program")
        return node

    def expand(self, helper: str, target: str) -> list[Check]:
        """The checks of `helper(target)`: its parameter stands for the function `target`."""
        node = self.helpers[helper]
        alias = {node.args.args[0].arg: target}
        return [check for stmt in node.body for check in self.statement(stmt, alias)]

    def statement(self, stmt: ast.stmt, alias: dict[str, str]) -> list[Check]:
        match stmt:
            case ast.Assert(test=test):
                return self.assertion(test, alias)
            case ast.Pass() | ast.Expr(value=ast.Constant(value=str())):
                return []
            case ast.Assign(targets=[ast.Name(id=name)], value=value):
                self.calls, work = [], self.work
                node = self.expr(value, alias)
                if isinstance(node, Static):
                    self.names[name] = node.value
                else:
                    self.names[name] = Deferred(node, tuple(self.calls), self.work - work)
                return []
            case ast.Assign(targets=[target], value=value):
                self.bind(stmt, target, self.compile_setup(stmt, value, alias).value)
                return []
            case ast.For(target=target, iter=iterable, body=body, orelse=[]):
                return self.loop(stmt, target, iterable, body, alias)
            case ast.Import(names=names):
                for item in names:
                    self.bind_module(stmt, item.name, item.asname or item.name)
                return []
            case ast.ImportFrom(module=str(module), names=names, level=0):
                self.bind_module(stmt, module, None)
                for item in names:
                    if item.name == "*":
                        raise Unsplittable(f"line {stmt.lineno}: `from {module} import *`")
                    self.names[item.asname or item.name] = _module_entry(module, item.name)
                return []
        raise Unsplittable(f"line {stmt.lineno}: unsupported statement `{_show(stmt)}`")

    def loop(self, stmt: ast.For, target: ast.expr, iterable: ast.expr, body, alias) -> list[Check]:
        """A `for` over a value computed here, unrolled: its body once per item, the target bound
        to the item (`for x, y in [(1, 2), (3, 4)]: assert f(x) == y`, `for i in range(10)`)."""
        items = self.items(stmt, iterable, alias, body)
        checks = []
        for item in items:
            self.bind(stmt, target, item)
            for inner in body:
                checks += self.statement(inner, alias)
        return checks

    def comprehension(self, node: ast.expr, elts: list[ast.expr], gens, alias) -> list[tuple[Node, ...]]:
        """The compiled `elts` per item of a comprehension whose iterables (and `if`s) are known
        here: `[f(x) for x in range(3)]` is three calls. Its names are restored after it."""
        line = node.lineno
        names = {n.id for g in gens for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        saved = {name: self.names[name] for name in names if name in self.names}
        out: list[tuple[Node, ...]] = []

        def level(index: int) -> None:
            if index == len(gens):
                out.append(tuple(self.expr(e, alias) for e in elts))
                return
            gen = gens[index]
            if gen.is_async:
                raise Unsplittable(f"line {line}: async comprehension")
            for item in self.items(node, gen.iter, alias, [*elts, *gen.ifs, *gens[index + 1 :]]):
                self.bind(node, gen.target, item)
                if all(self.known(node, cond, alias) for cond in gen.ifs):
                    level(index + 1)

        try:
            level(0)
        finally:
            for name in names:
                self.names.pop(name, None)
            self.names.update(saved)
        return out

    def known(self, node: ast.AST, expr: ast.expr, alias) -> Any:
        """The value of `expr`, which may not call the program (the calls are kept aside)."""
        calls, self.calls = self.calls, []
        try:
            part = self.expr(expr, alias)
            if not isinstance(part, Static) or self.calls:
                raise Unsplittable(
                    f"line {node.lineno}: `{_show(expr)}` calls the program; it must be known here"
                )
            return part.value
        finally:
            self.calls = calls

    def items(self, node: ast.AST, iterable: ast.expr, alias, body: list[ast.AST]) -> list:
        """The items of a loop's or comprehension's iterable, charged to MAX_UNROLLED, and to
        MAX_UNROLLED_NODES by the size of the `body` each compiles again: 5000 iterations of
        twenty asserts (600 characters of source) were 100k checks, minutes of compiling."""
        value = self.known(node, iterable, alias)
        try:
            self.unrolled += len(value)
            if self.unrolled > MAX_UNROLLED:
                raise Unsplittable(f"line {node.lineno}: loops of more than {MAX_UNROLLED} iterations in all")
            self.unrolled_nodes += len(value) * sum(1 for part in body for _ in ast.walk(part))
            if self.unrolled_nodes > MAX_UNROLLED_NODES:
                raise Unsplittable(
                    f"line {node.lineno}: loops that compile more than {MAX_UNROLLED_NODES} expression nodes"
                )
            return list(value)
        except TypeError as exc:
            raise Unsplittable(f"line {node.lineno}: iterating over `{_show(iterable)}`: {exc}") from None

    def bind(self, stmt: ast.stmt, target: ast.expr, value: Any) -> None:
        """`target = value` for a name or a (nested) tuple or list of names."""
        match target:
            case ast.Name(id=name):
                self.names[name] = value
                return
            case ast.Tuple(elts=elts) | ast.List(elts=elts) if not any(
                isinstance(e, ast.Starred) for e in elts
            ):
                try:
                    parts = list(value)
                except TypeError:
                    parts = None
                if parts is not None and len(parts) == len(elts):
                    for elt, part in zip(elts, parts, strict=True):
                        self.bind(stmt, elt, part)
                    return
                raise Unsplittable(
                    f"line {stmt.lineno}: cannot unpack {type(value).__name__} into `{_show(target)}`"
                )
        raise Unsplittable(f"line {stmt.lineno}: assignment to `{_show(target)}` (only names)")

    def bind_module(self, stmt: ast.stmt, module: str, name: str | None) -> None:
        if module not in MODULES:
            raise Unsplittable(
                f"line {stmt.lineno}: import of `{module}` (not a standard module the split evaluates)"
            )
        if name is not None:
            self.names[name] = MODULES[module]
            self.modules.add(id(MODULES[module]))

    def assertion(self, test: ast.expr, alias: dict[str, str]) -> list[Check]:
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return [check for value in test.values for check in self.assertion(value, alias)]
        line = test.lineno
        self.calls = []
        node = self.expr(test, alias)
        if isinstance(node, Static):
            if any(isinstance(n, ast.Call) for n in ast.walk(test)):
                # `assert max([1, 2]) == 2`: the program may define `max`; run as written it tests that
                raise Unsplittable(f"line {line}: the assert calls no function of the program")
            if _truth(node.value, line):
                return []
            raise Unsplittable(f"line {line}: assert of a false constant")
        return [Check(line, tuple(self.calls), node, _show(test))]

    # ---- expressions ----

    def expr(self, node: ast.expr, alias: dict[str, str]) -> Node:
        line = getattr(node, "lineno", 0)
        match node:
            case ast.Constant(value=value):
                if type(value) not in PLAIN_SCALARS:
                    raise Unsplittable(f"line {line}: `{_show(node)}` is not a supported literal")
                return Static(value)
            case ast.Name(id=name) if isinstance(self.names.get(name), Deferred):
                deferred = self.names[name]
                self.work += deferred.work
                self.charge(line, [])
                return deferred.use(self.calls)
            case ast.Name(id=name):
                return Static(self.name_value(name, alias, line))
            case ast.Attribute(value=ast.Name(id=base), attr=attr) if self.is_module(base, alias):
                return Static(self.attribute(self.names[base], base, attr, line))
            case ast.Attribute(value=ast.Attribute() as inner, attr=attr):
                outer = self.expr(inner, alias)
                if isinstance(outer, Static) and type(outer.value) is dict and attr in outer.value:
                    return Static(outer.value[attr])  # sys.float_info.epsilon
            case ast.UnaryOp(op=op, operand=operand) if type(op) in UNARY:
                return self.combine(line, UNARY[type(op)], [self.expr(operand, alias)])
            case ast.BinOp(left=left, op=op, right=right) if type(op) in BINARY:
                parts = [self.expr(left, alias), self.expr(right, alias)]
                return self.combine(line, BINARY[type(op)], parts)
            case ast.Compare(left=left, ops=ops, comparators=comparators):
                return self.compare(line, left, ops, comparators, alias)
            case ast.BoolOp(op=op, values=values):
                return self.boolean(line, isinstance(op, ast.And), [self.expr(v, alias) for v in values])
            case ast.Tuple(elts=elts) | ast.List(elts=elts) | ast.Set(elts=elts) if not any(
                isinstance(e, ast.Starred) for e in elts
            ):
                build = {ast.Tuple: tuple, ast.List: list, ast.Set: _keyed(set)}[type(node)]
                return self.combine(line, lambda *items: build(items), [self.expr(e, alias) for e in elts])
            case ast.Dict(keys=keys, values=values) if None not in keys:
                parts = [self.expr(p, alias) for pair in zip(keys, values, strict=True) for p in pair]
                return self.combine(line, _dict_of, parts)
            case ast.ListComp(elt=elt, generators=gens) | ast.SetComp(elt=elt, generators=gens):
                items = self.comprehension(node, [elt], gens, alias)
                build = list if isinstance(node, ast.ListComp) else _keyed(set)
                return self.combine(line, lambda *values: build(values), [n for (n,) in items])
            case ast.GeneratorExp(elt=elt, generators=gens):
                nodes = [n for (n,) in self.comprehension(node, [elt], gens, alias)]
                self.charge(line, nodes)
                if all(isinstance(n, Static) for n in nodes):
                    return Static([n.value for n in nodes])
                return lambda results: (_value(n, results) for n in nodes)  # lazy, for all() / any()
            case ast.DictComp(key=key, value=value, generators=gens):
                pairs = self.comprehension(node, [key, value], gens, alias)
                parts = [n for pair in pairs for n in pair]
                return self.combine(line, _dict_of, parts)
            case ast.Subscript(value=value, slice=ast.Slice(lower=lo, upper=hi, step=step)):
                bounds = [Static(None) if b is None else self.expr(b, alias) for b in (lo, hi, step)]
                return self.combine(line, lambda v, a, b, c: v[a:b:c], [self.expr(value, alias), *bounds])
            case ast.Subscript(value=value, slice=index):
                return self.combine(
                    line, operator.getitem, [self.expr(value, alias), self.expr(index, alias)]
                )
            case ast.Call(func=func, args=args, keywords=keywords):
                if any(isinstance(a, ast.Starred) for a in args) or any(k.arg is None for k in keywords):
                    raise Unsplittable(f"line {line}: `*` or `**` in a call")
                return self.call(node, func, args, keywords, alias)
        raise Unsplittable(f"line {line}: `{_show(node)}` is not supported by the split")

    def name_value(self, name: str, alias: dict[str, str], line: int) -> Any:
        if name in alias:
            raise Unsplittable(f"line {line}: `{name}` used other than called")
        if name in self.names:
            value = self.names[name]
            if isinstance(value, Opaque):
                raise Unsplittable(f"line {line}: `{value.name}` is {value.why}")
            if id(value) in self.modules or isinstance(value, Func):
                raise Unsplittable(f"line {line}: `{name}` used as a value")
            return value
        if name in TYPES:
            return TYPES[name]
        if name in BUILTINS and BUILTINS[name].fn in KEY_FUNCS:
            return BUILTINS[name].fn  # only useful as `key=`; as an argument it is refused
        raise Unsplittable(f"line {line}: `{name}` is not a literal or a name the asserts bind")

    def is_module(self, name: str, alias: dict[str, str]) -> bool:
        return name not in alias and id(self.names.get(name)) in self.modules

    @staticmethod
    def attribute(table: dict, base: str, attr: str, line: int) -> Any:
        value = table.get(attr, Opaque(f"{base}.{attr}"))
        if isinstance(value, Opaque):
            raise Unsplittable(f"line {line}: `{value.name}` is {value.why}")
        return value

    def call(self, node: ast.Call, func: ast.expr, args, keywords, alias) -> Node:
        line = node.lineno
        trusted = self.trusted_function(func, alias, line)
        if trusted is not None:
            bad = sorted({k.arg for k in keywords} - trusted.keywords)
            if bad:
                raise Unsplittable(f"line {line}: `{_show(func)}` takes no keyword {bad[0]!r} here")
            names = [k.arg for k in keywords]
            parts = [self.expr(a, alias) for a in args] + [self.expr(k.value, alias) for k in keywords]
            if "key" in names:
                key = parts[len(args) + names.index("key")]
                if not (isinstance(key, Static) and key.value in KEY_FUNCS):
                    raise Unsplittable(f"line {line}: `key=` only one of len, abs, str, int, float, tuple")
                if key.value in (set, frozenset, dict):  # `key=set`: each item's set, checked too
                    parts[len(args) + names.index("key")] = Static(_keyed(key.value))
            if trusted is BUILTINS["range"] and not all(isinstance(p, Static) for p in parts):
                # `sum(range(f(x)))`: 10**5 items per check from a one-int result, uncharged
                raise Unsplittable(f"line {line}: `range()` of a result of the program")
            count = len(args)
            fn = trusted.fn
            return self.combine(
                line, lambda *v: fn(*v[:count], **dict(zip(names, v[count:], strict=True))), parts
            )
        if isinstance(func, ast.Attribute):  # a method of a value: `f(x).lower()`
            if not any(func.attr in names for names in METHODS.values()):
                raise Unsplittable(
                    f"line {line}: method `.{func.attr}()` (of a program's object?) is not evaluated"
                )
            receiver = self.expr(func.value, alias)
            parts = [receiver, *(self.expr(a, alias) for a in args)]
            if keywords:
                raise Unsplittable(f"line {line}: keywords in a method call")
            method = func.attr
            return self.combine(line, lambda obj, *v: _method(obj, method)(*v), parts)
        if not isinstance(func, ast.Name):
            raise Unsplittable(f"line {line}: `{_show(func)}` is not a function of the program")
        name = func.id
        if name in self.names or name in self.helpers:
            raise Unsplittable(f"line {line}: `{name}` is not a function of the program")
        if alias.get(name, name)[:1].isupper():
            raise Unsplittable(f"line {line}: `{name}` looks like a class: its instances are not plain data")
        values = []
        for arg in [*args, *(k.value for k in keywords)]:
            part = self.expr(arg, alias)
            if not isinstance(part, Static):
                raise Unsplittable(
                    f"line {line}: `{_show(arg)}` is not computed before the call (it calls the program)"
                )
            self.charge(line, [part])  # it is marshalled into the sandbox's input once per call
            if not is_plain(part.value):
                raise Unsplittable(f"line {line}: the argument `{_show(arg)}` is not plain data")
            values.append(part.value)
        count = len(args)
        call = Call(
            alias.get(name, name),
            tuple(values[:count]),
            tuple(zip((k.arg for k in keywords), values[count:], strict=True)),
        )
        index = len(self.calls)
        self.calls.append(call)
        return lambda results: results[index]

    def trusted_function(self, func: ast.expr, alias, line: int) -> Func | None:
        match func:
            case ast.Name(id=name) if name in alias or name == self.entry_point:
                return None
            case ast.Name(id=name) if name in self.names:
                value = self.names[name]
                if isinstance(value, Opaque):
                    raise Unsplittable(f"line {line}: `{value.name}` is {value.why}")
                return value if isinstance(value, Func) else None
            case ast.Name(id=name) if name in BUILTINS:
                return BUILTINS[name]
            case ast.Attribute(value=ast.Name(id=base), attr=attr) if self.is_module(base, alias):
                value = self.attribute(self.names[base], base, attr, line)
                if not isinstance(value, Func):
                    raise Unsplittable(f"line {line}: `{base}.{attr}` is not a function")
                return value
        return None

    def charge(self, line: int, parts: list[Node]) -> None:
        """Count the size of the static values an operation uses against MAX_WORK: a large
        value named once and used in 10**4 unrolled asserts costs 10**4 times its size, here
        at split time and again when the results are judged."""
        for part in parts:
            if isinstance(part, Static):
                self.work += self.weight(part.value)
        if self.work > MAX_WORK:
            raise Unsplittable(f"line {line}: the asserts use more than {MAX_WORK} values' worth of data")

    def weight(self, value: Any) -> int:
        """Items in `value`, nested ones too (a str: one per 8 characters, a range: its length),
        cached per object."""
        known = self.weights.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        total, stack = 0, [value]
        while stack:
            item = stack.pop()
            total += 1
            if type(item) is str:
                total += len(item) // 8
            elif type(item) is range:  # `sum(range(10**5))` costs 10**5, not 1
                total += len(item)
            elif isinstance(item, dict):  # a Counter's or OrderedDict's values too
                stack += item.keys()
                stack += item.values()
            elif isinstance(item, CONTAINERS):  # a deque, a dict's `.keys()`: as large as theirs
                stack += item
        self.weights[id(value)] = (value, total)  # the value is kept: its id stays its own
        return total

    def combine(self, line: int, fn: Callable, parts: list[Node]) -> Node:
        """`fn` of the parts: computed now if all are static, else a function of the results."""
        self.charge(line, parts)
        if all(isinstance(p, Static) for p in parts):
            try:
                return Static(fn(*(p.value for p in parts)))
            except (
                TypeError,
                ValueError,
                ArithmeticError,
                LookupError,
                AttributeError,
                RecursionError,
            ) as exc:
                raise Unsplittable(f"line {line}: {type(exc).__name__}: {str(exc)[:100]}") from None
        return lambda results: fn(*(_value(p, results) for p in parts))

    def compare(self, line: int, left: ast.expr, ops, comparators, alias) -> Node:
        nodes = [self.expr(left, alias), *(self.expr(c, alias) for c in comparators)]
        for op, a, b in zip(ops, nodes, nodes[1:], strict=False):
            if isinstance(op, ast.Is | ast.IsNot) and not any(
                isinstance(n, Static) and any(n.value is ok for ok in IDENTITY_OK) for n in (a, b)
            ):
                raise Unsplittable(f"line {line}: `is` only with None, True, False or a type")
        fns = [COMPARE[type(op)] for op in ops]

        def chain(results: list) -> bool:  # lazy, as Python's: `0 < f(x) < len(f(x))`
            left = _value(nodes[0], results)
            for fn, node in zip(fns, nodes[1:], strict=True):
                right = _value(node, results)
                if not fn(left, right):
                    return False
                left = right
            return True

        return self.fold(line, chain, nodes)

    def boolean(self, line: int, conjunction: bool, parts: list[Node]) -> Node:
        def pick(results: list) -> Any:  # lazy, as Python's: `f(x) is None or len(f(x)) == 3`
            value = None
            for part in parts:
                value = _value(part, results)
                if bool(value) != conjunction:
                    return value
            return value

        return self.fold(line, pick, parts)

    def fold(self, line: int, lazy: Callable[[list], Any], parts: list[Node]) -> Node:
        """`lazy` (a function of the results that evaluates `parts` itself), now if all are static."""
        self.charge(line, parts)
        if all(isinstance(p, Static) for p in parts):
            return self.combine(line, lambda: lazy([]), [])
        return lazy


def _method(obj: Any, name: str) -> Callable:
    """The bound method `name` of a str, dict, list or tuple (exact types), if `METHODS` lists it."""
    allowed = METHODS.get(type(obj), frozenset())
    if name not in allowed:
        raise AttributeError(f"method {name!r} of a {type(obj).__name__} is not evaluated")
    return getattr(obj, name)


def _truth(value: Any, line: int) -> bool:
    try:
        return bool(value)
    except (TypeError, ValueError) as exc:  # pragma: no cover (plain values have a truth value)
        raise Unsplittable(f"line {line}: {exc}") from None


def _reason(exc: Unsplittable) -> str:
    text = str(exc)
    return text.partition(": ")[2] if text.startswith("line ") else text


def _one_parameter(args: ast.arguments) -> bool:
    return len(args.args) == 1 and not (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg)


def _show(node: ast.AST) -> str:
    text = ast.unparse(node).partition("\n")[0]
    return text if len(text) <= 60 else text[:57] + "..."
