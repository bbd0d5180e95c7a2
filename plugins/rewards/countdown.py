"""The countdown rule reward: an equation over the given numbers that reaches the target
(docs/algorithms.md §8).

The equation in the last <answer>...</answer> is parsed by a small recursive-descent parser over
integers, + - * / (also − × ÷), unary signs and parentheses, and evaluated exactly with
fractions. Nothing is ever passed to eval(): any other character is a parse error, so an
injection attempt is rejected before anything is evaluated. A trailing "= <integer>" (models
like to write "3 + 4 = 7") is ignored; a division by zero scores 0 (the expression has no value).
"""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Any, Union

MAX_TOKENS = 256  # bounds recursion depth and big-integer work on hostile input
MAX_DIGITS = 12
TOLERANCE = Fraction(1, 100_000)
OPERATORS = {"+": "+", "-": "-", "−": "-", "*": "*", "×": "*", "/": "/", "÷": "/"}
# [0-9], not \d, which also accepts "²" and "٣"; \s is str.isspace's whitespace
TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+−*×/÷()]))")
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
TRAILING_RESULT = re.compile(r"=\s*-?\d+\s*$")

# A parsed expression: an int literal, ("neg", node), or (op, left, right) with op in + - * /.
Node = Union[int, tuple]


class ParseError(ValueError):
    """The text is not an arithmetic expression over integers."""


def tokenize(text: str) -> list[Union[int, str]]:
    """Integers become ints; operators (normalised to + - * /) and parentheses stay strings."""
    tokens: list[Union[int, str]] = []
    at, end = 0, len(text.rstrip())
    while at < end:
        match = TOKEN.match(text, at)
        if match is None:
            raise ParseError(f"unexpected character {text[at:].lstrip()[0]!r} at {at}")
        number, sign = match.groups()
        if number is not None and len(number) > MAX_DIGITS:
            raise ParseError(f"number longer than {MAX_DIGITS} digits at {at}")
        tokens.append(int(number) if number is not None else OPERATORS.get(sign, sign))
        if len(tokens) > MAX_TOKENS:
            raise ParseError(f"more than {MAX_TOKENS} tokens")
        at = match.end()
    return tokens


class _Parser:
    """expr := term (("+"|"-") term)* ; term := factor (("*"|"/") factor)* ;
    factor := "-" factor | "+" factor | "(" expr ")" | integer."""

    def __init__(self, tokens: list[Union[int, str]]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> Union[int, str, None]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> Union[int, str]:
        tok = self.peek()
        if tok is None:
            raise ParseError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            node = (self.take(), node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.peek() in ("*", "/"):
            node = (self.take(), node, self.factor())
        return node

    def factor(self) -> Node:
        tok = self.take()
        if isinstance(tok, int):
            return tok
        if tok == "-":
            return ("neg", self.factor())
        if tok == "+":
            return self.factor()
        if tok == "(":
            node = self.expr()
            if self.take() != ")":
                raise ParseError("expected ')'")
            return node
        raise ParseError(f"unexpected {tok!r}")


def parse_equation(text: str) -> Node:
    """Parse an arithmetic expression; raises ParseError on anything else."""
    parser = _Parser(tokenize(text))
    node = parser.expr()
    if parser.peek() is not None:
        raise ParseError(f"unexpected {parser.peek()!r} after the expression")
    return node


def evaluate(node: Node) -> Fraction:
    """The exact value; raises ZeroDivisionError on division by zero."""
    if isinstance(node, int):
        return Fraction(node)
    if node[0] == "neg":
        return -evaluate(node[1])
    return ARITHMETIC[node[0]](evaluate(node[1]), evaluate(node[2]))


def literals(node: Node) -> list[int]:
    """The integer literals of the expression, left to right."""
    if isinstance(node, int):
        return [node]
    return [n for child in node[1:] for n in literals(child)]


def extract_answer(response: str) -> str | None:
    """The text between the last <answer> and the </answer> after it, or None."""
    start = response.rfind("<answer>")
    if start < 0:
        return None
    end = response.find("</answer>", start)
    if end < 0:
        return None
    return TRAILING_RESULT.sub("", response[start + len("<answer>") : end]).strip()


def _target_and_numbers(ground_truth: Any) -> tuple[int, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be {{target, numbers}}, got {ground_truth!r}")
    return int(ground_truth["target"]), [int(n) for n in ground_truth["numbers"]]


def countdown_reward(
    response: str, ground_truth: Any, extra_info: dict | None = None, *, format_score: float = 0.1, score: float = 1.0
) -> float:
    """score when the equation uses each given number exactly once and equals the target within
    1e-5; format_score (verl's 0.1) for a well-formed equation that misses; 0.0 otherwise."""
    target, numbers = _target_and_numbers(ground_truth)
    equation = extract_answer(response)
    if not equation:
        return 0.0
    try:
        tree = parse_equation(equation)
        value = evaluate(tree)
    except (ParseError, ZeroDivisionError):
        return 0.0
    if sorted(literals(tree)) != sorted(numbers):
        return format_score
    return score if abs(value - target) <= TOLERANCE else format_score
