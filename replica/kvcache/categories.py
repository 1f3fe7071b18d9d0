"""Request categories for the workload-aware policy: request type plus turn number.

KVCache-in-the-wild keys its reuse model on (type, turn). A serving system knows the type from
its API and the turn from the session; a trace or a bare prompt may carry neither, so the turn
is read off the prompt itself: a follow-up turn's prompt repeats the previous turn's whole
prompt, so its turn is 1 + the number of earlier prompts that end inside its chain of blocks
(block hashes chain, so an earlier prompt's last block appearing in this chain means that whole
prompt is a prefix of this one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixmesh.cache_registry.types import BlockHash


class TurnCategorizer:
    """``category(kind, blocks)`` = ``"{kind}-{turn}"``, turns above ``max_turn`` folded into it;
    remembers the last block of at most ``max_tracked`` prompts (oldest forgotten first)."""

    def __init__(self, max_turn: int = 8, max_tracked: int = 1 << 20) -> None:
        if max_turn < 1 or max_tracked < 1:
            raise ValueError("max_turn and max_tracked must be >= 1")
        self.max_turn = max_turn
        self.max_tracked = max_tracked
        self._ends: OrderedDict[BlockHash, None] = OrderedDict()

    def turn(self, blocks: Sequence[BlockHash]) -> int:
        """This prompt's turn; records it as a prompt end for later ones."""
        ends = self._ends
        # The last block is its own end: a repeat of an earlier prompt is not a new turn.
        earlier = sum(1 for block in blocks[:-1] if block in ends)
        if blocks:
            ends[blocks[-1]] = None
            ends.move_to_end(blocks[-1])
            if len(ends) > self.max_tracked:
                ends.popitem(last=False)
        return 1 + earlier

    def category(self, kind: str, blocks: Sequence[BlockHash]) -> str:
        return f"{kind}-{min(self.max_turn, self.turn(blocks))}"
