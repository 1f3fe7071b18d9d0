"""What a cache policy's decisions cost: a ``CachePolicy`` that times the calls a cache makes
on its hot paths (``victim`` per eviction, ``on_request`` per request) and forwards them all.

The cache simulator wraps each row's policy in one, so the per-eviction cost (issue 18's
budget: 2 us on this machine) is measured on the same replay as the hit rate. A timer read
costs ~0.05 us; it is included, as it would be in any caller.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy import BlockRef, CachePolicy, Promotion


class PolicyTimer:
    """``policy``, with the time spent in ``victim`` and ``on_request`` added up."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.victims = 0
        self.victim_s = 0.0
        self.requests = 0
        self.request_s = 0.0

    @property
    def victim_us(self) -> float:
        """Mean microseconds per ``victim`` call (0 when there was none)."""
        return self.victim_s / self.victims * 1e6 if self.victims else 0.0

    @property
    def request_us(self) -> float:
        """Mean microseconds per ``on_request`` call."""
        return self.request_s / self.requests * 1e6 if self.requests else 0.0

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        started = time.perf_counter()
        self.policy.on_request(blocks, category)
        self.request_s += time.perf_counter() - started
        self.requests += 1

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        started = time.perf_counter()
        block = self.policy.victim(tier, pinned)
        self.victim_s += time.perf_counter() - started
        self.victims += 1
        return block

    def on_insert(self, tier: int, block: BlockRef) -> None:
        self.policy.on_insert(tier, block)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        self.policy.on_remove(tier, block, dropped)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        self.policy.touch(tier, blocks)

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return self.policy.admit(tier, block, displaced)

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return self.policy.promotions(pinned)
