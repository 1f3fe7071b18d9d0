"""Predicted next use (issue 18, item 3): evict the block predicted to be used again furthest
ahead, with the prediction learned online from the cache's own history.

Belady's rule needs each block's next use; this policy estimates it. The model is a table, not
a network, so that a decision fits in the engine's step: a block's features at its latest use
name its cell, how many times it has been used (1, 2, 3-4, 5+: reuse begets reuse) and its
request's turn (1, or a follow-up: the session structure ``TurnCategorizer`` reads off the
prompts, as the workload-aware policy's categories). Each cell keeps a histogram of the gaps
between a use and the next use of the same block (log2 bins from ``resolution_s``), plus how
many uses saw no next use within ``horizon_s``. Training needs no labels from outside: every
use of a block closes its previous use's sample with the gap observed, whether or not a tier
still held the block (a miss is a lesson too, as in learning-relaxed Belady), and a sample still
open after the horizon closes as "not used again". Every ``refit_samples`` closed samples the
prediction tables are rebuilt and the counts halved, so the model follows a change of workload.

Prediction: a block idle for ``age`` in cell ``c`` is next used ``E[gap - age | gap > age]``
later, from ``c``'s histogram ("not used again" counts as twice the horizon). A cell with few
samples borrows the table of the cell one use count below (all cells pooled for the first).
Each cell is one LRU queue per tier and only the queues' heads compete (O(cells) per eviction),
which is exact when the prediction grows with idle time.

A block is worth nothing without its parent, so a parent must never look better to evict than
its child. A parent is used whenever its child is (its latest use is no older) and at least as
often, so the tables are made to grow with idle time and to shrink with the use count (running
maxima): then a chain's tail always goes before its head. (Depth in the prompt is no feature
for that reason: it would rank a fresh prompt's head below its own tail.) Until the model has
``min_samples`` samples the least recently used head goes: plain LRU. Ties (the tables are
coarse) go to the least recent, as in LRU, whose order puts a chain's tail before its head.
Admission: every evicted block; no promotion.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Container, Sequence
from math import frexp
from typing import cast

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import NextUseConfig
from prefixmesh.replica.kvcache.policy.base import (
    BlockRef,
    Clock,
    Promotion,
    TieredQueues,
    deepest_first,
    oldest_idle,
)

_COUNT_BUCKETS = (0, 1, 2, 2)
"""Use count 1, 2, 3-4 -> bucket; 5 and more are bucket 3."""
_COUNTS = 4
_CELLS = _COUNTS * 2
_PRUNE_TO = 0.75
_NEVER_FACTOR = 2.0
"""A use not followed by another within the horizon is priced as this many horizons away."""


def turn_base(category: str) -> int:
    """The first cell of a request of ``category``'s turn (``kind-turn``; anything else is a
    first turn)."""
    _, _, turn = category.rpartition("-")
    return _COUNTS if turn.isdigit() and int(turn) > 1 else 0


def cell_of(uses: int, base: int) -> int:
    """The feature cell of a block used ``uses`` times, latest by a request whose turn's first
    cell is ``base``."""
    return base + (_COUNT_BUCKETS[uses - 1] if uses <= len(_COUNT_BUCKETS) else _COUNTS - 1)


class GapModel:
    """Per cell, a histogram of reuse gaps; ``remaining(cell, age)`` reads its latest tables."""

    def __init__(self, config: NextUseConfig) -> None:
        self.config = config
        self._bins = config.bins
        # frexp's exponent of gap / resolution is the bin: [0, r) -> 0, [r, 2r) -> 1, ...
        self._scale = 1.0 / config.resolution_s
        self._never_s = _NEVER_FACTOR * config.horizon_s
        self._counts = [[0.0] * (self._bins + 1) for _ in range(_CELLS)]  # last: not again
        self._tables: list[list[float]] = []
        self.trained = False
        """Tables built: until then the policy is LRU."""
        self._closed = 0
        mids = [0.5 * config.resolution_s]
        mids += [0.75 * config.resolution_s * 2.0**b for b in range(1, self._bins)]
        self._mids = mids

    def bin_of(self, seconds: float) -> int:
        exponent = frexp(seconds * self._scale)[1] if seconds > 0 else 0
        return 0 if exponent < 0 else exponent if exponent < self._bins else self._bins - 1

    def reused(self, cell: int, gap_s: float) -> None:
        self._counts[cell][self.bin_of(gap_s)] += 1.0
        self._closed_one()

    def not_reused(self, cell: int) -> None:
        self._counts[cell][self._bins] += 1.0
        self._closed_one()

    def remaining(self, cell: int, age_s: float) -> float:
        """Seconds until the next use of a block idle ``age_s`` in ``cell`` (trained only)."""
        return self._tables[cell][self.bin_of(age_s)]

    def _closed_one(self) -> None:
        self._closed += 1
        if self._closed >= self.config.refit_samples:
            self.refit()

    def refit(self) -> None:
        """Rebuild the tables from the counts, then halve the counts (decay)."""
        self._closed = 0
        minimum = self.config.min_samples
        pooled = [sum(column) for column in zip(*self._counts, strict=True)]
        if sum(pooled) < minimum:
            return
        pooled_table = self._table(pooled)
        tables: list[list[float]] = []
        for cell, counts in enumerate(self._counts):
            if sum(counts) >= minimum:
                tables.append(self._table(counts))
            elif cell % _COUNTS:  # few samples: as a block used less often (no better)
                tables.append(tables[-1])
            else:
                tables.append(pooled_table)
        # A parent (used more, lately) never predicted further than its child: the tables
        # grow with idle time and shrink with the use count.
        for base in range(0, _CELLS, _COUNTS):
            for cell in reversed(range(base, base + _COUNTS - 1)):
                tables[cell] = list(map(max, tables[cell], tables[cell + 1]))
        self._tables = [list(itertools.accumulate(table, max)) for table in tables]
        self.trained = True
        for counts in self._counts:
            for b in range(len(counts)):
                counts[b] *= 0.5

    def _table(self, counts: list[float]) -> list[float]:
        """Expected time to the next use for each idle-time bin, from one histogram."""
        mids, never = self._mids, counts[self._bins]
        table = []
        for age_bin in range(self._bins):
            age = mids[age_bin]
            weight = never
            total = never * max(self._never_s - age, self.config.horizon_s)
            for b in range(age_bin, self._bins):
                n = counts[b]
                if n:
                    weight += n
                    total += n * max(mids[b] - age, 0.25 * mids[b])
            table.append(total / weight if weight else self._never_s)
        return table


class NextUsePolicy:
    name = "nextuse"

    def __init__(self, config: NextUseConfig, *, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.model = GapModel(config)
        self._last: dict[BlockHash, tuple[float, int, int, int]] = {}
        """Block -> its latest use: (time, cell, uses, serial), resident or not."""
        self._open: deque[tuple[float, BlockHash, int]] = deque()
        """(time, block, serial) of the uses whose next use is not seen yet, oldest first."""
        self._serial = itertools.count()
        self._order = itertools.count()
        self._tiers = TieredQueues()
        self._tier_of: dict[BlockHash, int] = {}
        self._queued_at: dict[BlockHash, int] = {}
        """Block -> when it entered its queue's tail (LRU order across the queues)."""

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        now = self.clock()
        self._expire(now)
        horizon, model, last = self.config.horizon_s, self.model, self._last
        base = turn_base(category)
        for ref in deepest_first(blocks):
            block = ref.block
            previous = last.get(block)
            uses = 1
            if previous is not None:
                when, cell, uses, _ = previous
                if now - when <= horizon:  # else _expire closed it as not used again
                    model.reused(cell, now - when)
                uses += 1
            cell = cell_of(uses, base)
            serial = next(self._serial)
            last[block] = (now, cell, uses, serial)
            self._open.append((now, block, serial))
            tier = self._tier_of.get(block)
            if tier is not None:
                self._put(tier, block, cell)
        if len(last) > self.config.max_tracked_blocks:
            self._prune()

    def on_insert(self, tier: int, block: BlockRef) -> None:
        b = block.block
        if b not in self._last:
            # Inserted without a request (an answer's blocks stored for the next turn, a
            # restored index): it dates from its parent's latest use, in its parent's turn, so
            # that it never looks better to keep than its parent.
            parent = None if block.parent is None else self._last.get(block.parent)
            if parent is None:
                self._last[b] = (self.clock(), cell_of(1, 0), 1, -1)
            else:
                self._last[b] = (parent[0], cell_of(1, parent[1] - parent[1] % _COUNTS), 1, -1)
        self._tier_of[b] = tier
        self._put(tier, b, self._last[b][1])

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self._tiers[tier].remove(block)
        del self._tier_of[block]
        del self._queued_at[block]

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        queues, last = self._tiers[tier], self._last
        for ref in deepest_first(blocks):
            if ref.block in queues:
                self._put(tier, ref.block, last[ref.block][1])

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        heads = self._tiers[tier].heads(pinned)
        queued_at = self._queued_at
        if not self.model.trained:
            best = min(heads, key=lambda head: queued_at[head[1]], default=None)
            return None if best is None else best[1]
        now, remaining, last = self.clock(), self.model.remaining, self._last
        chosen: BlockHash | None = None
        chosen_key = (0.0, 0)
        for cell, block in heads:
            # On a tie the least recent: LRU order puts a chain's tail before its head.
            key = (remaining(cast(int, cell), now - last[block][0]), -queued_at[block])
            if chosen is None or key > chosen_key:
                chosen, chosen_key = block, key
        return chosen

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return True

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return ()

    def _put(self, tier: int, block: BlockHash, cell: int) -> None:
        self._tiers[tier].put(block, cell)
        self._queued_at[block] = next(self._order)

    def _expire(self, now: float) -> None:
        """Close the samples older than the horizon whose block was not used since."""
        cutoff = now - self.config.horizon_s
        opened, last, model = self._open, self._last, self.model
        while opened and opened[0][0] < cutoff:
            _, block, serial = opened.popleft()
            latest = last.get(block)
            if latest is not None and latest[3] == serial:
                model.not_reused(latest[1])

    def _prune(self) -> None:
        """Forget the oldest latest-use records of blocks no tier holds."""
        keep = int(self.config.max_tracked_blocks * _PRUNE_TO)
        for block in oldest_idle(self._last, self._tier_of, keep):
            del self._last[block]
