"""HotPrefix's configurable formulas: precedence, parentheses, errors."""

from __future__ import annotations

import pytest

from prefixmesh.replica.kvcache.policy.formula import check_grows_with_clock, compile_formula


def test_precedence_parentheses_and_numbers() -> None:
    assert compile_formula("frequency + clock / length")(3, 100, 50) == 5.0
    assert compile_formula("(frequency + clock) / length")(3, 97, 50) == 2.0
    assert compile_formula("clock + frequency / length")(10, 1, 5) == 3.0
    assert compile_formula("2 * -frequency - .5")(3, 0, 1) == -6.5
    assert compile_formula("frequency / clock")(1, 0, 1) == float("inf")


@pytest.mark.parametrize("text", ["", "frequency +", "(clock", "clock clock", "depth", "2 ** 3"])
def test_bad_formulas_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        compile_formula(text)


def test_an_eviction_priority_must_not_fall_as_the_clock_grows() -> None:
    check_grows_with_clock(compile_formula("frequency * clock"), "f*c", 255, 16.0)
    with pytest.raises(ValueError, match="must not fall"):
        check_grows_with_clock(compile_formula("frequency / clock"), "f/c", 255, 16.0)
