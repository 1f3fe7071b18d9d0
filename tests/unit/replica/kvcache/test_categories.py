"""Request categories: the turn read off the prompt."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.categories import TurnCategorizer


def h(*blocks: int) -> list[BlockHash]:
    return [BlockHash(b) for b in blocks]


def test_a_prompt_that_extends_earlier_prompts_is_a_later_turn() -> None:
    turns = TurnCategorizer(max_turn=3)
    assert turns.category("text", h(1, 2)) == "text-1"
    assert turns.category("text", h(1, 2, 3, 4)) == "text-2"  # contains prompt 1's end (2)
    assert turns.category("text", h(1, 2)) == "text-1"  # a repeat is not a new turn
    assert turns.category("api", h(1, 2, 3, 4, 5, 6)) == "api-3"
    assert turns.category("api", h(1, 2, 3, 4, 5, 6, 7, 8)) == "api-3"  # folded into max_turn
    assert turns.category("text", h(9)) == "text-1"
    assert turns.turn([]) == 1


def test_only_the_newest_ends_are_remembered() -> None:
    turns = TurnCategorizer(max_tracked=2)
    turns.turn(h(1))
    turns.turn(h(2))
    turns.turn(h(3))  # forgets 1
    assert turns.turn(h(1, 2, 3, 4)) == 3
