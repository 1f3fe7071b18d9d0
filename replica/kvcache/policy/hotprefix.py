"""HotPrefix (seed-000, SIGMOD'25) at block granularity: hotness tracking, hotness-aware
eviction, selective admission to the lower tier, periodic promotion.

- Hotness record per block (a block is a prefix-tree node here; an exact dict stands in for the
  paper's cuckoo filter): ``frequency``, cumulative over the block's whole history, including
  spells in no tier, saturating at ``max_frequency``; ``clock``, reset to ``max_age`` on every
  access and decremented once per ``aging_interval_requests`` requests, floor 0. Kept as the
  aging tick of the last access, so aging costs nothing: clock = max(0, max_age - ticks since).
- Every request updates every block of its prompt, so a parent is always at least as hot as
  its child (both fields), which is why only leaves need to be eviction candidates (the paper's
  invariant): within one frequency bucket blocks are in access order with a request's deepest
  block first, so the coldest block is a leaf.
- Eviction (Eq. 5): the lowest ``frequency + clock / length``. Blocks are bucketed by frequency
  and kept in access order within a bucket, where the clock only falls with age, so the victim
  is the best of the buckets' oldest blocks: O(distinct frequencies), at most 255.
- Admission of a block evicted from tier t-1 to tier t (paper §3.3.2): frequency at least
  ``freq_threshold``, and, when tier t is full, hotness (Eq. 6: frequency * clock) above that of
  the block it would displace (tier t's own next victim). Otherwise it is dropped.
- Promotion (Algorithm 2), every ``promotion_interval_requests`` requests: the hottest
  lower-tier blocks whose parent is in the engine tier (the paper's host roots) each replace
  an engine-tier leaf that is colder by Eq. 6, taken in eviction order; victims are dropped, as
  in the paper, and a root whose parent was just chosen as a victim is skipped.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator, Sequence
from typing import cast

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import HotPrefixConfig
from prefixmesh.replica.kvcache.policy.base import (
    ENGINE_TIER,
    BlockRef,
    Promotion,
    TieredQueues,
    deepest_first,
)
from prefixmesh.replica.kvcache.policy.formula import check_grows_with_clock, compile_formula

_PRUNE_TO = 0.75
"""A prune of hotness records keeps this fraction of ``max_tracked_blocks``."""


class HotPrefixPolicy:
    name = "hotprefix"

    def __init__(self, config: HotPrefixConfig, *, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.config = config
        self._length = float(block_tokens if config.length_unit == "tokens" else 1)
        self._priority = compile_formula(config.eviction_priority)
        check_grows_with_clock(
            self._priority, config.eviction_priority, config.max_age, self._length
        )
        self._hotness = compile_formula(config.admission_hotness)
        self._freq: dict[BlockHash, int] = {}
        self._last_tick: dict[BlockHash, int] = {}
        self._requests = 0
        self._tick = 0
        self._tiers = TieredQueues()
        self._tier_of: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._children: dict[BlockHash | None, set[BlockHash]] = {}
        """Resident blocks by parent (the parent may be in no tier)."""
        self._roots: set[BlockHash] = set()
        """Lower-tier blocks whose parent is in the engine tier, or that start a prompt."""

    # ---- hotness -------------------------------------------------------------------------------

    def frequency(self, block: BlockHash) -> int:
        return self._freq.get(block, 0)

    def clock(self, block: BlockHash) -> int:
        last = self._last_tick.get(block)
        if last is None:
            return 0
        return max(0, self.config.max_age - (self._tick - last))

    def priority(self, block: BlockHash) -> float:
        """Eq. 5, the eviction order: lowest first."""
        return float(self._priority(self._freq.get(block, 0), self.clock(block), self._length))

    def hotness(self, block: BlockHash) -> float:
        """Eq. 6, for admission and promotion."""
        return float(self._hotness(self._freq.get(block, 0), self.clock(block), self._length))

    # ---- events --------------------------------------------------------------------------------

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        self._requests += 1
        self._tick = self._requests // self.config.aging_interval_requests
        cap = self.config.max_frequency
        freq, last, tier_of = self._freq, self._last_tick, self._tier_of
        for ref in deepest_first(blocks):
            block = ref.block
            value = freq[block] = min(cap, freq.get(block, 0) + 1)
            last[block] = self._tick
            tier = tier_of.get(block)
            if tier is not None:
                self._tiers[tier].put(block, value)
        if len(freq) > self.config.max_tracked_blocks:
            self._prune()

    def on_insert(self, tier: int, block: BlockRef) -> None:
        b = block.block
        if b not in self._freq:  # inserted without a request (a restored index)
            self._freq[b] = 1
            self._last_tick[b] = self._tick
        self._tier_of[b] = tier
        self._parent[b] = block.parent
        self._children.setdefault(block.parent, set()).add(b)
        self._tiers[tier].put(b, self._freq[b])
        if tier == ENGINE_TIER:
            self._roots.discard(b)
            for child in self._children.get(b, ()):
                if self._tier_of[child] != ENGINE_TIER:
                    self._roots.add(child)
        elif block.parent is None or self._tier_of.get(block.parent) == ENGINE_TIER:
            self._roots.add(b)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self._tiers[tier].remove(block)
        self._roots.discard(block)
        if tier == ENGINE_TIER:
            self._roots.difference_update(self._children.get(block, ()))
        del self._tier_of[block]
        parent = self._parent.pop(block)
        siblings = self._children[parent]
        siblings.discard(block)
        if not siblings:
            del self._children[parent]

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        queues = self._tiers[tier]
        for ref in deepest_first(blocks):
            if ref.block in queues:
                queues.put(ref.block, self._freq[ref.block])

    # ---- decisions -----------------------------------------------------------------------------

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        best: BlockHash | None = None
        best_key = (0.0, 0)
        length, max_age, tick, last = self._length, self.config.max_age, self._tick, self._last_tick
        priority = self._priority
        for bucket, block in self._tiers[tier].heads(pinned):
            freq = cast(int, bucket)
            key = (priority(freq, max(0, max_age - (tick - last[block])), length), freq)
            if best is None or key < best_key:
                best, best_key = block, key
        return best

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        if not self.config.admission:
            return True
        if self._freq.get(block, 0) < self.config.freq_threshold:
            return False
        return displaced is None or self.hotness(block) > self.hotness(displaced)

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        config = self.config
        if not config.promotion or not self._roots:
            return ()
        if self._requests % config.promotion_interval_requests:
            return ()
        hot = self.hotness
        candidates = heapq.nlargest(
            config.promotion_max_blocks, self._roots, key=lambda b: (hot(b), b)
        )
        coldest = self.eviction_stream(ENGINE_TIER, pinned)
        chosen: set[BlockHash] = set()
        drop = config.promotion_victims == "drop"
        plan: list[Promotion] = []
        victim = next(coldest, None)
        for block in candidates:
            heat = hot(block)
            parent = self._parent[block]
            if parent in chosen:
                continue  # its parent leaves the engine tier in this plan
            while victim is not None and (victim == parent or not self._leaf(victim, chosen)):
                # The root's own parent, or a block with a child in the engine tier (possible
                # once an older record was forgotten): look further.
                victim = next(coldest, None)
            if victim is None or hot(victim) >= heat:
                break  # every engine-tier leaf left is at least as hot: so for colder roots
            chosen.add(victim)
            plan.append(Promotion(block, self._tier_of[block], (victim,), drop_victims=drop))
            victim = next(coldest, None)
        return plan

    def eviction_stream(self, tier: int, pinned: Container[BlockHash]) -> Iterator[BlockHash]:
        """``tier``'s unpinned blocks in eviction order, lazily (a merge of the frequency
        buckets, each already in order); the tier must not change while it is consumed."""
        length, max_age, tick, last = self._length, self.config.max_age, self._tick, self._last_tick
        priority = self._priority
        heap: list[tuple[float, int, int, BlockHash, Iterator[BlockHash]]] = []

        def push(freq: int, blocks: Iterator[BlockHash]) -> None:
            for block in blocks:
                if block not in pinned:
                    clock = max(0, max_age - (tick - last[block]))
                    key = priority(freq, clock, length)
                    heapq.heappush(heap, (key, freq, len(heap), block, blocks))
                    return

        for bucket, queue in self._tiers[tier].queues():
            push(cast(int, bucket), iter(queue))
        while heap:
            _, freq, _, block, blocks = heapq.heappop(heap)
            yield block
            push(freq, blocks)

    def _leaf(self, block: BlockHash, leaving: set[BlockHash]) -> bool:
        """No child of ``block`` stays in the engine tier."""
        return not any(
            self._tier_of[c] == ENGINE_TIER and c not in leaving
            for c in self._children.get(block, ())
        )

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _prune(self) -> None:
        """Forget the coldest records of blocks no tier holds, down to ``_PRUNE_TO``."""
        keep = int(self.config.max_tracked_blocks * _PRUNE_TO)
        idle = [b for b in self._freq if b not in self._tier_of]
        excess = len(self._freq) - keep
        if excess <= 0 or not idle:
            return
        for block in heapq.nsmallest(excess, idle, key=lambda b: (self.hotness(b), b)):
            del self._freq[block]
            del self._last_tick[block]
