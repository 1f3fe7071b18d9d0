"""The baselines: LRU and LFU over every tier (admit every evicted block, never promote)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import cast

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.base import (
    BlockRef,
    Promotion,
    TieredQueues,
    deepest_first,
)


class LRUPolicy:
    """Least recently used goes first; a request's deepest block before its head (as vLLM's
    free queue does)."""

    name = "lru"

    def __init__(self) -> None:
        self._tiers = TieredQueues()

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        pass

    def on_insert(self, tier: int, block: BlockRef) -> None:
        self._tiers[tier].put(block.block, None)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self._tiers[tier].remove(block)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        queues = self._tiers[tier]
        for ref in deepest_first(blocks):
            if ref.block in queues:
                queues.put(ref.block, None)

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        return next((block for _, block in self._tiers[tier].heads(pinned)), None)

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return True

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return ()


class LFUPolicy:
    """Least frequently used goes first, LRU among equals. A block's count is the requests that
    used it since it entered the cache; it follows the block between tiers and restarts when the
    block leaves every tier (SGLang's LFU counts per tree node the same way)."""

    name = "lfu"

    def __init__(self) -> None:
        self._tiers = TieredQueues()
        self._count: dict[BlockHash, int] = {}
        self._tier_of: dict[BlockHash, int] = {}

    def count(self, block: BlockHash) -> int:
        return self._count.get(block, 0)

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        for ref in deepest_first(blocks):
            tier = self._tier_of.get(ref.block)
            if tier is not None:
                count = self._count[ref.block] = self._count[ref.block] + 1
                self._tiers[tier].put(ref.block, count)

    def on_insert(self, tier: int, block: BlockRef) -> None:
        count = self._count.setdefault(block.block, 1)
        self._tier_of[block.block] = tier
        self._tiers[tier].put(block.block, count)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self._tiers[tier].remove(block)
        del self._tier_of[block]
        if dropped:
            del self._count[block]

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        queues = self._tiers[tier]
        for ref in deepest_first(blocks):
            if ref.block in queues:
                queues.put(ref.block, self._count[ref.block])

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        heads = self._tiers[tier].heads(pinned)
        best = min(heads, key=lambda head: cast(int, head[0]), default=None)
        return None if best is None else best[1]

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return True

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return ()
