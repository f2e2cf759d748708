"""`calculator`: arithmetic on numbers, evaluated from the `ast` of the expression (no `eval`).

Numbers, `+ - * / // % **`, unary `+`/`-` and parentheses; no names, calls, attributes or any
other syntax. Every intermediate result is bounded (MAX_INT_BITS, finite floats) and a power is
refused *before* it is computed when its result would pass the bound, so `9**9**9` answers an
error at once instead of running for hours. Tool-only: the final answer is scored by a verifier.
"""

from __future__ import annotations

import ast
import math
import operator

from asyncrl.proto.environments import StepRequest, StepResponse, StepStatus, ToolCall
from asyncrl.services.reward.environments.base import Environment, NoArgs, function, reply, text_argument

MAX_EXPRESSION_CHARS = 1000  # a longer expression is not arithmetic a policy should need a tool for
MAX_DEPTH = 100  # nesting of the syntax tree; keeps the recursive evaluation far from Python's stack limit
MAX_INT_BITS = 4096  # ~1233 digits: cheap to multiply, and str() stays under the 4300-digit limit

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """The expression is not arithmetic this calculator evaluates, or its value is out of bounds."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`, or CalculatorError (ZeroDivisionError for a division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    return _eval(tree.body, 0)


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(OPERATORS[type(node.op)](left, right))
        except OverflowError:
            raise CalculatorError("result too large") from None
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r:.40}"
    else:
        what = {ast.Name: "names", ast.Call: "calls", ast.Attribute: "attributes"}.get(
            type(node), type(node).__name__
        )
    raise CalculatorError(f"unsupported: {what} (only numbers, + - * / // % ** and parentheses)")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass MAX_INT_BITS before computing it (a float result
    overflows cheaply and is caught as OverflowError)."""
    ints = isinstance(base, int) and isinstance(exponent, int)
    # (|base| ≥ 2: an exponent past MAX_INT_BITS is too large already, and the product below
    # would overflow a float for an exponent past ~2**1023, e.g. 3**2**1024)
    if (
        ints
        and exponent > 0
        and abs(base) > 1
        and (exponent > MAX_INT_BITS or exponent * math.log2(abs(base)) > MAX_INT_BITS)
    ):
        raise CalculatorError("result too large")


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    return value


class CalculatorEnvironment(Environment):
    name = "calculator"
    description = "A calculator tool for arithmetic; the final answer is scored by the job's verifier."
    tools = [
        function(
            "calculator",
            "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}},
        )
    ]
    Args = NoArgs

    async def call(self, args: NoArgs, req: StepRequest, call: ToolCall) -> StepResponse:
        expression = text_argument(call, "expression")
        if expression is None:
            return reply('calculator takes {"expression": "<arithmetic>"}', StepStatus.invalid_call)
        try:
            return reply(str(evaluate(expression)))
        except ZeroDivisionError:
            return reply("error: division by zero", StepStatus.tool_error)
        except CalculatorError as exc:
            return reply(f"error: {exc}", StepStatus.tool_error)
