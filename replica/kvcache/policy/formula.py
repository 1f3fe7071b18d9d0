"""HotPrefix's configurable hotness formulas ("x op1 y op2 z" over clock, frequency, length).

A formula is an arithmetic expression over ``frequency``, ``clock``, ``length`` and numbers with
``+ - * /`` and parentheses, usual precedence, compiled once into a function of
(frequency, clock, length). Nothing is evaluated with ``eval``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

Formula = Callable[[float, float, float], float]
"""(frequency, clock, length) -> value."""

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(frequency|clock|length)|([-+*/()]))")
_VARIABLES = {"frequency": 0, "clock": 1, "length": 2}


def compile_formula(text: str) -> Formula:
    tokens = _tokenize(text)
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def atom() -> Formula:
        token = take() if peek() is not None else None
        if token is None:
            raise ValueError(f"formula {text!r} ends early")
        if token == "(":
            inner = expression()
            if peek() != ")":
                raise ValueError(f"formula {text!r}: missing )")
            take()
            return inner
        if token == "-":
            operand = atom()
            return lambda f, c, n: -operand(f, c, n)
        if token in _VARIABLES:
            index = _VARIABLES[token]
            return lambda f, c, n: (f, c, n)[index]
        try:
            value = float(token)
        except ValueError:
            raise ValueError(f"formula {text!r}: unexpected {token!r}") from None
        return lambda f, c, n: value

    def term() -> Formula:
        left = atom()
        while peek() in ("*", "/"):
            op, right, previous = take(), atom(), left
            left = _mul(previous, right) if op == "*" else _div(previous, right)
        return left

    def expression() -> Formula:
        left = term()
        while peek() in ("+", "-"):
            op, right, previous = take(), term(), left
            left = _add(previous, right) if op == "+" else _sub(previous, right)
        return left

    result = expression()
    if position != len(tokens):
        raise ValueError(f"formula {text!r}: unexpected {tokens[position]!r}")
    return result


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    index = 0
    while index < len(text.rstrip()):
        match = _TOKEN.match(text, index)
        if match is None:
            raise ValueError(f"formula {text!r}: cannot read {text[index:]!r}")
        tokens.append(next(group for group in match.groups() if group is not None))
        index = match.end()
    if not tokens:
        raise ValueError("empty formula")
    return tokens


def _add(a: Formula, b: Formula) -> Formula:
    return lambda f, c, n: a(f, c, n) + b(f, c, n)


def _sub(a: Formula, b: Formula) -> Formula:
    return lambda f, c, n: a(f, c, n) - b(f, c, n)


def _mul(a: Formula, b: Formula) -> Formula:
    return lambda f, c, n: a(f, c, n) * b(f, c, n)


def _div(a: Formula, b: Formula) -> Formula:
    def divide(f: float, c: float, n: float) -> float:
        denominator = b(f, c, n)
        return a(f, c, n) / denominator if denominator else float("inf")

    return divide


def check_grows_with_clock(formula: Formula, text: str, max_age: int, length: float) -> None:
    """Eviction needs a block's priority to fall as its clock does (so the oldest block of a
    frequency bucket is its coldest): reject formulas where it does not."""
    for frequency in (1, 2, 10, 255):
        values = [formula(frequency, clock, length) for clock in range(max_age + 1)]
        if any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(f"eviction priority {text!r} must not fall as clock grows")
