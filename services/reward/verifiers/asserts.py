"""Split `assert_code` into calls made in the sandbox and comparisons made in the reward service.

An assert run next to the program it tests can be gamed by that program: a result whose
`__eq__` is always true, a `math.isclose` patched in `sys.modules`, a forged end-of-run
sentinel, a `sys.settrace` hook that jumps over the asserts. So the trusted side parses the
asserts with `ast`; only the calls (function name and literal arguments) enter the sandbox
(`call_harness.py`), and their results come back as plain data, compared here with the
service's own `==`, `abs`, `math.isclose`. The expected values never enter the sandbox.

Supported, each statement at module level or in the body of a one-parameter function such as
HumanEval's `def check(candidate)` that is then called as `check(name)` (or named by the spec's
`entry_point`), with the parameter standing for that name:
* `assert f(args)`, `assert not f(args)`, and `and` of supported forms;
* `assert f(args) OP y` and `assert y OP f(args)`, OP one of == != < <= > >= in, not in, and
  `is` / `is not` with y None, True or False;
* `assert abs(f(args) - y) OP eps` (either order inside `abs`, either side of OP);
* `assert math.isclose(f(args), y, rel_tol=..., abs_tol=...)` (either order; a bare `isclose`
  after `from math import isclose`);
* `assert <literal>` (true: skipped), an assert's message (never evaluated), `import math`,
  `from math import isclose`, docstrings, `pass`, and `NAME = literal` at module level, which
  binds NAME for the later asserts only (the program does not see it).
`f` is a plain name (the program's function, or a builtin); args, keyword values and y are
literals: None, bool, int, float, str, and tuples, lists, sets, dicts of them, negative
numbers, `float('inf')` / `float('nan')` and the like, `set()`, `tuple()`, `list()`, `dict()`,
`frozenset()` of a literal, names bound above, and `+ - * / **` of numbers (ints of at most
MAX_ARITH_BITS bits, exponents of at most 64). Results compare as Python values, a tuple
stays a tuple (`f() == (1, 2)` fails for a list, as it would in the program's own process).

Anything else makes the whole `assert_code` unsplittable (`Unsplittable` says which line and
why): setup statements, loops, calls nested in arguments, `set(f(x)) == ...`, other
arithmetic, bytes and complex numbers. The code verifier then runs it as written, inside the
sandbox, and reports that (see `code.py`).

Differences from running the asserts in the program's process: every call runs, even after a
failed assert (the first failure decides; a later call that raises or hangs makes the run a
runtime error or timeout, reward 0 all the same); names bound by `assert_code` are not
visible to the program; a result that is not plain data (a class instance, a generator, a
subclass of a plain type, an int of more than ~4200 digits) fails.
"""

from __future__ import annotations

import ast
import json
import marshal
import math
import operator
from dataclasses import dataclass, field
from typing import Any

from asyncrl.services.reward.verifiers.call_harness import decode

OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
EVAL = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
    "is": operator.is_,
    "is not": operator.is_not,
}
ISCLOSE_KEYWORDS = ("rel_tol", "abs_tol")
CONVERSIONS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict}
NOT_TESTED = {"abs", "float", *CONVERSIONS}  # read as parts of a literal, never as the tested call
ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_ARITH_BITS = 256  # ints in literal arithmetic (and `**` exponents: 64): no bignum towers to compute
TYPE_NAME_CHARS = 80  # a type name reported by the sandbox, cut: the program chose it


class Unsplittable(ValueError):
    """`assert_code` outside the supported forms; the message says where and why."""


class BadResults(ValueError):
    """The sandbox's answer is missing or is not a well-formed result line."""


@dataclass(frozen=True)
class Check:
    """One assert: `func(*args, **kwargs)` is called in the sandbox, its result judged here.

    `op`: a comparison (`EVAL` key) of the result with `expected`, `expected` on the left when
    `swapped`; with `distance_from` set the result's `abs(result - distance_from)` is compared
    instead. Or `isclose` (to `expected`, with `tol`), `truthy`, `falsy`."""

    line: int
    func: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    op: str = "truthy"
    expected: Any = None
    swapped: bool = False
    distance_from: float | None = None
    tol: tuple[tuple[str, float], ...] = ()

    def judge(self, result: Any) -> bool:
        """Whether `result` (plain data) passes; a comparison that raises fails."""
        try:
            if self.op == "truthy":
                return bool(result)
            if self.op == "falsy":
                return not result
            if self.op == "isclose":
                return math.isclose(result, self.expected, **dict(self.tol))
            value = result if self.distance_from is None else abs(result - self.distance_from)
            left, right = (self.expected, value) if self.swapped else (value, self.expected)
            return bool(EVAL[self.op](left, right))
        except (TypeError, ValueError, OverflowError, RecursionError):
            return False


def split_asserts(source: str, entry_point: str | None = None) -> list[Check]:
    """The checks of `source` in order; `entry_point`: also run `check(entry_point)` after it."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise Unsplittable(f"does not parse: {exc}") from None
    splitter = _Splitter()
    checks = splitter.module(tree.body)
    if entry_point is not None:
        if "check" not in splitter.helpers:
            raise Unsplittable("entry_point given but no `def check(candidate)`")
        checks += splitter.expand("check", entry_point)
    if not checks:
        raise Unsplittable("no assert is run")
    return checks


def calls_line(checks: list[Check]) -> str:
    """The harness's input line: the calls, without the expected values (hex of `marshal`,
    which keeps tuples, sets and non-finite floats, and costs the sandbox no import)."""
    return marshal.dumps([(c.func, c.args, c.kwargs) for c in checks]).hex()


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
                out.append((kind, decode(value)))
            elif kind == "not_plain" and type(value) is str:
                out.append((kind, value[:TYPE_NAME_CHARS]))
            else:
                raise ValueError(f"bad result kind {str(kind)[:20]!r}")
        return out
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadResults(f"malformed result line: {str(exc)[:200]}") from None


def first_failure(checks: list[Check], results: list[tuple[str, Any]]) -> str | None:
    """Why the first failing check fails (`line N: ...`), or None if all pass."""
    for check, (kind, value) in zip(checks, results, strict=True):
        if kind == "not_plain":
            return f"line {check.line}: {check.func}() returned a {value}, not plain data"
        if not check.judge(value):
            return f"line {check.line}: assert failed"
    return None


def _refuse(constant: str) -> None:
    raise ValueError(f"bare {constant} in the result line")


class _Splitter:
    def __init__(self):
        self.constants: dict[str, Any] = {}  # NAME = literal at module level
        self.helpers: dict[str, ast.FunctionDef] = {}  # one-parameter functions of asserts
        self.math_names = {"math"}  # `math` may come from the program's own import
        self.isclose_names: set[str] = set()

    def module(self, body: list[ast.stmt]) -> list[Check]:
        checks = []
        for stmt in body:
            match stmt:
                case ast.Assign(targets=[ast.Name(id=name)], value=value):
                    try:
                        self.constants[name] = self.literal(value)
                    except Unsplittable:
                        raise Unsplittable(
                            f"line {stmt.lineno}: setup `{_show(stmt)}` (only NAME = literal)"
                        ) from None
                case ast.FunctionDef(name=name, args=args, decorator_list=[]) if _one_parameter(args):
                    self.helpers[name] = stmt
                case ast.Expr(value=ast.Call(func=ast.Name(id=name), args=[ast.Name(id=target)])) if (
                    name in self.helpers and not stmt.value.keywords
                ):
                    checks += self.expand(name, target)
                case _:
                    checks += self.statement(stmt, {})
        return checks

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
            case ast.Import(names=names) if all(a.name == "math" for a in names):
                self.math_names.update(a.asname or "math" for a in names)
                return []
            case ast.ImportFrom(module="math", names=ns, level=0) if all(a.name == "isclose" for a in ns):
                self.isclose_names.update(a.asname or "isclose" for a in ns)
                return []
        raise Unsplittable(f"line {stmt.lineno}: unsupported statement `{_show(stmt)}`")

    def assertion(self, test: ast.expr, alias: dict[str, str]) -> list[Check]:
        line = test.lineno
        match test:
            case ast.Constant():
                if self.literal(test):
                    return []
                raise Unsplittable(f"line {line}: assert of a false constant")
            case ast.UnaryOp(op=ast.Not(), operand=operand) if call := self.call(operand, alias):
                return [Check(line, *call, op="falsy")]
            case ast.Call(func=func, args=[a, b], keywords=keywords) if self.is_isclose(func):
                tol = tuple((k.arg, self.literal(k.value)) for k in keywords)
                if any(name not in ISCLOSE_KEYWORDS for name, _ in tol):
                    raise Unsplittable(f"line {line}: isclose takes only {ISCLOSE_KEYWORDS}")
                call, target, _ = self.sides(a, b, alias, line)
                return [Check(line, *call, op="isclose", expected=target, tol=tol)]
            case ast.Call() if call := self.call(test, alias):
                return [Check(line, *call)]
            case ast.BoolOp(op=ast.And(), values=values):
                return [check for value in values for check in self.assertion(value, alias)]
            case ast.Compare(left=left, ops=[op], comparators=[right]):
                name = OPS[type(op)]
                measured, expected, swapped = self.sides(left, right, alias, line, distance=True)
                if name in ("is", "is not") and not any(expected is c for c in (None, True, False)):
                    raise Unsplittable(f"line {line}: `{name}` only with None, True or False")
                (func, args, kwargs), distance_from = measured
                check = Check(line, func, args, kwargs, name, expected, swapped, distance_from)
                return [check]
        raise Unsplittable(f"line {line}: unsupported assert `{_show(test)}`")

    def sides(self, a: ast.expr, b: ast.expr, alias, line: int, distance: bool = False):
        """(the call side, the literal's value, whether the literal is `a`). With `distance`, the
        call side is `(call, y)` and also matches `abs(call - y)` / `abs(y - call)` (else y is None)."""
        for node, other, swapped in ((a, b, False), (b, a, True)):
            measured = self.measured(node, alias) if distance else self.call(node, alias)
            if measured is not None:
                return measured, self.literal(other), swapped
        raise Unsplittable(f"line {line}: neither side is a call of a function on literals")

    def measured(self, node: ast.expr, alias):
        match node:
            case ast.Call(func=ast.Name(id="abs"), args=[ast.BinOp(left=a, op=ast.Sub(), right=b)]):
                call, target, _ = self.sides(a, b, alias, node.lineno)
                if type(target) not in (int, float):
                    raise Unsplittable(f"line {node.lineno}: abs() of a difference with a non-number")
                return call, target
        call = self.call(node, alias)
        return None if call is None else (call, None)

    def call(self, node: ast.expr, alias) -> tuple[str, tuple, dict] | None:
        """`(func, args, kwargs)` if `node` calls a plain name, None if it is no call of a name."""
        match node:
            case ast.Call(func=ast.Name(id=name), args=args, keywords=keywords) if name not in NOT_TESTED:
                if name in self.constants or name in self.helpers or name in self.isclose_names:
                    raise Unsplittable(f"line {node.lineno}: `{name}` is not a function of the program")
                if any(k.arg is None for k in keywords):
                    raise Unsplittable(f"line {node.lineno}: `**` in a call")
                args = tuple(self.literal(a) for a in args)
                return alias.get(name, name), args, {k.arg: self.literal(k.value) for k in keywords}
        return None

    def is_isclose(self, func: ast.expr) -> bool:
        match func:
            case ast.Attribute(value=ast.Name(id=module), attr="isclose"):
                return module in self.math_names
            case ast.Name(id=name):
                return name in self.isclose_names
        return False

    def literal(self, node: ast.expr) -> Any:
        match node:
            case ast.Constant(value=value) if type(value) in (type(None), bool, int, float, str):
                return value
            case ast.UnaryOp(op=ast.USub() | ast.UAdd() as op, operand=operand):
                value = self.literal(operand)
                if type(value) in (int, float):
                    return -value if isinstance(op, ast.USub) else value
            case ast.BinOp(left=left, op=op, right=right) if type(op) in ARITH or type(op) is ast.Pow:
                return self.arithmetic(node, self.literal(left), op, self.literal(right))
            case ast.List(elts=elts):
                return [self.literal(e) for e in elts]
            case ast.Tuple(elts=elts):
                return tuple(self.literal(e) for e in elts)
            case ast.Set(elts=elts):
                return self.hashed(node, lambda: {self.literal(e) for e in elts})
            case ast.Dict(keys=keys, values=values) if None not in keys:
                pairs = [(self.literal(k), self.literal(v)) for k, v in zip(keys, values, strict=True)]
                return self.hashed(node, lambda: dict(pairs))
            case ast.Call(func=ast.Name(id="float"), args=[ast.Constant(value=str(text))], keywords=[]):
                try:
                    return float(text)
                except ValueError:
                    pass
            case ast.Call(func=ast.Name(id=name), args=[] | [_] as args, keywords=[]) if name in CONVERSIONS:
                return self.hashed(node, lambda: CONVERSIONS[name](*(self.literal(a) for a in args)))
            case ast.Name(id=name) if name in self.constants:
                return self.constants[name]
        raise Unsplittable(f"line {node.lineno}: `{_show(node)}` is not a literal")

    @staticmethod
    def arithmetic(node: ast.BinOp, a: Any, op: ast.operator, b: Any) -> int | float:
        def small(x: Any, bits: int) -> bool:
            return type(x) is float or (type(x) is int and x.bit_length() <= bits)

        if isinstance(op, ast.Pow):
            ok = small(a, 64) and type(b) is int and abs(b) <= 64
        else:
            ok = small(a, MAX_ARITH_BITS) and small(b, MAX_ARITH_BITS)
        if not ok:
            raise Unsplittable(f"line {node.lineno}: arithmetic `{_show(node)}` beyond small numbers")
        try:
            return operator.pow(a, b) if isinstance(op, ast.Pow) else ARITH[type(op)](a, b)
        except (ZeroDivisionError, OverflowError) as exc:
            raise Unsplittable(f"line {node.lineno}: {exc}") from None

    @staticmethod
    def hashed(node: ast.expr, build):
        try:
            return build()
        except Unsplittable:
            raise
        except (TypeError, ValueError) as exc:  # an unhashable key or member, dict() of non-pairs
            raise Unsplittable(f"line {node.lineno}: {exc}") from None


def _one_parameter(args: ast.arguments) -> bool:
    return len(args.args) == 1 and not (args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg)


def _show(node: ast.AST) -> str:
    text = ast.unparse(node).partition("\n")[0]
    return text if len(text) <= 60 else text[:57] + "..."
