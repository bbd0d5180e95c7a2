"""The MATH rule reward: the response's last \\boxed{...} against the ground truth.

Both sides go through one normaliser, so equal answers written differently compare equal:
\\dfrac and \\tfrac are \\frac; \\left/\\right, spacing commands, "$", degrees, percent signs,
trailing units (\\text{ cm}, " dollars"), a trailing "." and a leading "x =" are removed;
\\frac12 is \\frac{1}{2}; and every plain rational number (3, 3.0, 0.5, .5, 1/2, \\frac{2}{4},
-\\frac{1}{2}, 1,000) is rewritten as one canonical reduced form, so 0.5 equals \\frac{1}{2}.
Anything richer (expressions, intervals, matrices) is compared as normalised text.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 1000  # normalising is quadratic in nesting; no real answer is this long
TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\{")
SPACING = re.compile(r"\\[,;:! ]|~")
LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")  # not \rightarrow
SMALL_FRAC = re.compile(r"\\[dt]frac(?![a-zA-Z])")
WORD_UNITS = re.compile(r"^(-?[\d.,]+)\s+[a-zA-Z]+(?:\s+[a-zA-Z]+)*$")
THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
VARIABLE = re.compile(r"[a-zA-Z]{1,2}|\\[a-zA-Z]+")
DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")
SLASH = re.compile(r"(-?\d+)/(\d+)")
FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")


def brace_group(text: str, open_at: int) -> tuple[str, int] | None:
    """text[open_at] is "{": return (its content, index after the matching "}"), or None when
    unbalanced. Escaped braces (\\{ \\}) are content, not structure."""
    depth, i = 0, open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i], i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The argument of the last \\boxed / \\fbox: \\boxed{...} (brace-matched) or \\boxed x."""
    at, command = max((text.rfind(c), c) for c in BOX_COMMANDS)
    if at < 0:
        return None
    rest = text[at + len(command) :]
    if rest.startswith("{"):
        group = brace_group(rest, 0)
        return group[0] if group else None
    if rest.startswith(" "):  # \boxed 5: the argument runs to the next space or "$"
        arg = re.match(r"[^\s$]*", rest.lstrip())
        return arg.group(0) or None
    return None


def _unwrap_text(s: str) -> str:
    """Drop trailing \\text{...} units after a value; keep the words of any other \\text{...}."""
    while True:
        matches = list(TEXT_COMMANDS.finditer(s))
        if not matches:
            return s
        m = matches[-1]
        group = brace_group(s, m.end() - 1)
        if group is None:
            return s
        content, end = group
        if not s[end:].strip() and s[: m.start()].strip():  # "5\text{ cm}" -> "5"
            s = s[: m.start()]
        else:
            s = s[: m.start()] + content + s[end:]


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; \\sqrt2 -> \\sqrt{2}."""
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    out, i = [], 0
    while (at := s.find("\\frac", i)) >= 0:
        out.append(s[i : at + 5])
        i = at + 5
        for _ in range(2):
            if i < len(s) and s[i] == "{":
                group = brace_group(s, i)
                if group is None:
                    return "".join(out) + s[i:]
                out.append("{" + group[0] + "}")
                i = group[1]
            elif i < len(s):
                out.append("{" + s[i] + "}")
                i += 1
    return "".join(out) + s[i:]


def _as_rational(s: str) -> Fraction | None:
    """The value of a plain rational number string, or None."""
    try:
        if DECIMAL.fullmatch(s):
            return Fraction(s)
        if m := SLASH.fullmatch(s):
            return Fraction(int(m.group(1)), int(m.group(2)))
        if m := FRAC.fullmatch(s):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
    except ZeroDivisionError:
        return None
    return None


def _canonical(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _strip_variable(s: str) -> str:
    """ "x=5" -> "5": a single "=" after a short variable name is answer decoration."""
    if s.count("=") == 1:
        left, right = s.split("=")
        if VARIABLE.fullmatch(left):
            return right
    return s


def normalize(answer: str) -> str:
    """The canonical text of a math answer (see the module docstring)."""
    s = answer.strip().replace("\n", "")
    s = LEFT_RIGHT.sub("", s)
    s = SMALL_FRAC.sub(r"\\frac", s).replace("\\displaystyle", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _unwrap_text(s)
    s = SPACING.sub(" ", s).strip()
    if m := WORD_UNITS.match(s):  # "10 dollars" -> "10"; "5x" has no space and is kept
        s = m.group(1)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _strip_variable(s)
    while s.startswith("{") and (group := brace_group(s, 0)) and group[1] == len(s):
        s = group[0]
    if THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(?<!\d)\.(\d)", r"0.\1", s)  # ".5" -> "0.5"
    s = _fix_fracs(s)
    value = _as_rational(s)
    return _canonical(value) if value is not None else s


def math_reward(response: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the last \\boxed answer of the response normalises to the ground truth, else 0.0.
    A ground truth that itself holds a \\boxed{...} is compared by its boxed part."""
    answer = last_boxed(response)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    truth = str(ground_truth)
    if any(c in truth for c in BOX_COMMANDS):
        truth = last_boxed(truth) or truth
    expected = normalize(truth)
    return 1.0 if expected and normalize(answer) == expected else 0.0
