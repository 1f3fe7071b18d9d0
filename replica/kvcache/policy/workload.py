"""The workload-aware eviction policy of KVCache-in-the-wild (seed-003, ATC'25 §4.2).

Each request has a category (its type and turn number, e.g. ``text-1``, ``api-1``), and a
block belongs to the category of the request that used it last. Per category, the time until a
block is used again follows an exponential distribution that is stable over an hour, so it is
fitted online from the reuses seen in the last ``fit_window_s``:

- ``rate`` = 1 / mean reuse time (maximum likelihood), over the window's reuse samples;
- ``p`` = the share of the window's accesses that were used again (not every block is reused);
- ``life`` = the ``lifespan_quantile`` of the reuse times: past it the probability is 0 (the
  lifespan regulator, so that a long-tailed fit does not keep a dead block alive).

A block idle for ``t`` is used again with probability x / (x + 1 - p), x = p * exp(-rate * t):
the chance that it is reused given that it was not reused in ``t`` (the paper does not print its
closed form; p * exp(-rate * t) alone would rank two categories with the same x but different p
equally). The victim is the block with the lowest (probability, -offset): a less likely block
first, and among equals the one deeper in its prompt. Within a category the probability falls
with idle time, so each category is one LRU queue and only the queues' heads compete: O(number
of categories) per eviction. No frequency term (blocks die soon after their last burst).
Admission: every evicted block; no promotion.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import WorkloadAwareConfig
from prefixmesh.replica.kvcache.policy.base import (
    BlockRef,
    Clock,
    Promotion,
    TieredQueues,
    deepest_first,
    oldest_idle,
)

_PRUNE_TO = 0.75


@dataclass(frozen=True, slots=True)
class ReuseFit:
    """One category's fitted reuse model."""

    p: float
    """Share of accesses reused later."""
    rate: float
    """Per second: 1 / mean reuse time."""
    life_s: float
    """Reuse probability is 0 past this idle time."""
    samples: int

    def probability(self, idle_s: float) -> float:
        if idle_s > self.life_s:
            return 0.0
        x = self.p * math.exp(-self.rate * max(0.0, idle_s))
        rest = 1.0 - self.p
        return 1.0 if rest <= 0 else x / (x + rest)


FALLBACK_FIT = ReuseFit(p=0.5, rate=1.0, life_s=math.inf, samples=0)
"""Before any reuse was seen: recency alone (every category alike, so plain LRU)."""


class _Window:
    """One category's reuse samples and access counts within the fit window."""

    __slots__ = ("accesses", "num_accesses", "reuses")

    def __init__(self) -> None:
        self.reuses: deque[tuple[float, float]] = deque()
        """(time, reuse time) of each reuse of a block this category used."""
        self.accesses: deque[tuple[float, int]] = deque()
        """(time, blocks) accessed by this category's requests."""
        self.num_accesses = 0

    def expire(self, before: float, max_samples: int) -> None:
        while self.reuses and (self.reuses[0][0] < before or len(self.reuses) > max_samples):
            self.reuses.popleft()
        while self.accesses and self.accesses[0][0] < before:
            self.num_accesses -= self.accesses.popleft()[1]


class ReuseModel:
    """Per-category exponential reuse-time fits over a sliding window, refitted periodically."""

    def __init__(self, config: WorkloadAwareConfig) -> None:
        self.config = config
        self._windows: dict[str, _Window] = {}
        self._fits: dict[str, ReuseFit] = {}
        self._pooled = FALLBACK_FIT
        self._fitted_at: float | None = None

    def record_access(self, category: str, blocks: int, now: float) -> None:
        window = self._window(category)
        window.accesses.append((now, blocks))
        window.num_accesses += blocks

    def record_reuse(self, category: str, reuse_s: float, now: float) -> None:
        self._window(category).reuses.append((now, max(0.0, reuse_s)))

    def _window(self, category: str) -> _Window:
        window = self._windows.get(category)
        if window is None:
            window = self._windows[category] = _Window()
        return window

    def maybe_refit(self, now: float) -> None:
        if self._fitted_at is None or now - self._fitted_at >= self.config.refit_interval_s:
            self.refit(now)

    def refit(self, now: float) -> None:
        config = self.config
        before = now - config.fit_window_s
        pooled_gaps: list[float] = []
        pooled_accesses = 0
        fits: dict[str, ReuseFit] = {}
        for category, window in self._windows.items():
            window.expire(before, config.max_samples_per_category)
            gaps = [gap for _, gap in window.reuses]
            pooled_gaps += gaps
            pooled_accesses += window.num_accesses
            if len(gaps) >= config.min_samples:
                fits[category] = self._fit(gaps, window.num_accesses)
        self._fits = fits
        if len(pooled_gaps) >= config.min_samples:
            self._pooled = self._fit(pooled_gaps, pooled_accesses)
        self._fitted_at = now

    def _fit(self, gaps: list[float], accesses: int) -> ReuseFit:
        mean = max(sum(gaps) / len(gaps), 1e-6)
        p = min(1.0, len(gaps) / accesses) if accesses else 1.0
        life = math.inf
        if self.config.lifespan_regulator:
            ordered = sorted(gaps)
            rank = math.ceil(self.config.lifespan_quantile * len(ordered)) - 1
            life = ordered[min(len(ordered) - 1, max(0, rank))]
        return ReuseFit(p=p, rate=1.0 / mean, life_s=life, samples=len(gaps))

    def fit(self, category: str) -> ReuseFit:
        return self._fits.get(category, self._pooled)


class WorkloadAwarePolicy:
    name = "workload"

    def __init__(self, config: WorkloadAwareConfig, *, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.model = ReuseModel(config)
        self._last: dict[BlockHash, tuple[float, str]] = {}
        """Last access (time, category) of every tracked block, resident or not."""
        self._tiers = TieredQueues()
        self._tier_of: dict[BlockHash, int] = {}
        self._position: dict[BlockHash, int] = {}

    def category_of(self, block: BlockHash) -> str | None:
        last = self._last.get(block)
        return None if last is None else last[1]

    def reuse_probability(self, block: BlockHash) -> float:
        when, category = self._last[block]
        return self.model.fit(category).probability(self.clock() - when)

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        now = self.clock()
        model, last, tier_of = self.model, self._last, self._tier_of
        for ref in deepest_first(blocks):
            block = ref.block
            previous = last.get(block)
            if previous is not None:
                model.record_reuse(previous[1], now - previous[0], now)
            last[block] = (now, category)
            tier = tier_of.get(block)
            if tier is not None:
                self._tiers[tier].put(block, category)
        model.record_access(category, len(blocks), now)
        model.maybe_refit(now)
        if len(last) > self.config.max_tracked_blocks:
            self._prune()

    def on_insert(self, tier: int, block: BlockRef) -> None:
        b = block.block
        if b not in self._last:  # inserted without a request (a restored index)
            self._last[b] = (self.clock(), "")
        self._tier_of[b] = tier
        self._position[b] = block.position
        self._tiers[tier].put(b, self._last[b][1])

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self._tiers[tier].remove(block)
        del self._tier_of[block]
        del self._position[block]

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        queues, last = self._tiers[tier], self._last
        for ref in deepest_first(blocks):
            if ref.block in queues:
                queues.put(ref.block, last[ref.block][1])

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        now = self.clock()
        best: BlockHash | None = None
        best_key = (0.0, 0)
        for _, block in self._tiers[tier].heads(pinned):
            when, category = self._last[block]
            key = (self.model.fit(category).probability(now - when), -self._position[block])
            if best is None or key < best_key:
                best, best_key = block, key
        return best

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return True

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return ()

    def _prune(self) -> None:
        """Forget the oldest last-access records of blocks no tier holds."""
        keep = int(self.config.max_tracked_blocks * _PRUNE_TO)
        for block in oldest_idle(self._last, self._tier_of, keep):
            del self._last[block]
