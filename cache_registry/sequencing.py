"""Per-replica event sequencing: detect duplicates, gaps and resets (the rule every backend uses).

The Redis backend runs the same rule in Lua (``redis_scripts.PUBLISH``); the contract suite checks
both against each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefixmesh.cache_registry.types import CacheEvent

MAX_EPOCH = 2**53 - 1
"""Epochs are compared as Lua numbers (doubles) in Redis, so they stay below 2**53."""


@dataclass(frozen=True, slots=True)
class SequenceState:
    epoch: int
    seq: int


class SeqAction(enum.Enum):
    APPLY = "apply"
    RESET_AND_APPLY = "reset"
    """A newer epoch: purge the replica's entries, then apply."""
    SKIP = "skip"
    """Already applied, or from an older epoch."""


@dataclass(frozen=True, slots=True)
class SeqDecision:
    action: SeqAction
    gap: bool


def check_sequence(state: SequenceState | None, event: CacheEvent) -> SeqDecision:
    if not 0 <= event.epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be in [0, 2**53), got {event.epoch}")
    if state is None:
        return SeqDecision(SeqAction.APPLY, gap=event.seq > 0)
    if event.epoch > state.epoch:
        return SeqDecision(SeqAction.RESET_AND_APPLY, gap=event.seq > 0)
    if event.epoch < state.epoch or event.seq <= state.seq:
        return SeqDecision(SeqAction.SKIP, gap=False)
    return SeqDecision(SeqAction.APPLY, gap=event.seq > state.seq + 1)
