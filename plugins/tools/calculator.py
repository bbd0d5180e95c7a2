"""calculator: exact arithmetic by parsing, never eval.

The expression is parsed with ast (mode "eval") and only number literals, + - * / // % **, unary
+ and -, and parentheses are evaluated, on fractions.Fraction: 1/3*3 is exactly 1, and integers
of any size (within the bounds below) stay exact. Integral results print as integers, others as
decimals with up to 12 significant digits. Anything else (names, calls, strings, ^) is a
ToolError whose message the model reads.

Bounds keep one call cheap: 1,000 characters of expression, exponents up to 1,000 in magnitude,
and numbers of at most 4,000 digits (Python refuses to print an int of more than 4,300 digits).
A fractional exponent (2 ** 0.5) is computed in floating point, the one inexact case.
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
from fractions import Fraction

from minirl.agent.tools import ToolError, tool_options

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_DIGITS = 4000
SIGNIFICANT_DIGITS = 12
_MAX_BITS = int(MAX_DIGITS * math.log2(10))
_ALLOWED_CHARS = frozenset("0123456789+-*/%().eE_ \t\n")

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses. "
            "Returns the value (an integer when the result is whole)."
        ),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (2 + 3) * 4 / 7"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """The calculator tool (config: timeout_s, default 5)."""

    name = "calculator"

    def __init__(self, config: dict):
        self.timeout_s = tool_options(config, {"timeout_s": 5.0}, self.name)["timeout_s"]
        self.schema = config.get("tool_schema") or SCHEMA

    def __call__(self, arguments: dict, **sample) -> str:
        return format_number(evaluate(arguments.get("expression")))


def evaluate(expression: object) -> Fraction:
    """The exact value of an arithmetic expression; ToolError for anything else."""
    if not isinstance(expression, str):
        raise ToolError("the expression must be a string such as (2 + 3) * 4")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters; split the work")
    bad = sorted(set(expression) - _ALLOWED_CHARS)
    if bad:
        hint = "; use ** for powers" if "^" in bad else ""
        raise ToolError(f"unsupported character {bad[0]!r}: only numbers, + - * / // % ** and parentheses{hint}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _eval(tree.body)
    except SyntaxError as exc:
        raise ToolError(f"cannot parse the expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # a literal beyond Python's digit limit, a float overflow
        raise ToolError(f"cannot evaluate the expression: {exc}") from None


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    raise ToolError(f"unsupported syntax ({type(node).__name__}): only numbers, + - * / // % ** and parentheses")


def _number(value: object) -> Fraction:
    """A literal as a Fraction; a float literal by its shortest decimal text (0.1 is 1/10)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError(f"unsupported literal {value!r}: only numbers")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("a number literal is too large")
        return _checked(Fraction(repr(value)))
    return _checked(Fraction(value))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        return _float_power(base, exponent)
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise ToolError(f"the exponent {e} is beyond +-{MAX_EXPONENT}")
    if base == 0 and e < 0:
        raise ToolError("division by zero (zero to a negative power)")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length()) * abs(e)
    if bits > _MAX_BITS + 64:
        raise ToolError(f"the result would have more than {MAX_DIGITS} digits")
    return base**e


def _float_power(base: Fraction, exponent: Fraction) -> Fraction:
    """base ** exponent for a fractional exponent, in floating point (the result is irrational)."""
    try:
        result = float(base) ** float(exponent)
    except (OverflowError, ZeroDivisionError):
        raise ToolError("the power is out of range") from None
    if isinstance(result, complex):
        raise ToolError("a negative number to a fractional power has no real value")
    if not math.isfinite(result):
        raise ToolError("the power is out of range")
    return Fraction(result)


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ToolError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return value


def format_number(value: Fraction) -> str:
    """An integer as is; anything else as a decimal of up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as ctx:
        ctx.prec = SIGNIFICANT_DIGITS
        ctx.Emax, ctx.Emin = decimal.MAX_EMAX, decimal.MIN_EMIN
        quotient = (decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).normalize()
    if -7 < quotient.adjusted() < SIGNIFICANT_DIGITS:
        return format(quotient, "f")
    return format(quotient, "e")
