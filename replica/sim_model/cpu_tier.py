"""The engine model's CPU tier: which blocks it holds, with the evictions and admissions of a
``CachePolicy`` (the KV connector's own policies, at ``Tier.CPU``), bookkeeping only.

Blocks enter it when the engine tier evicts them (a written copy of a block vLLM is about to
free) and stay after a load back (a write-through copy). The policy decides which held block
leaves for a new one and whether the new one is worth it (``admit``), and hears each request's
blocks when it runs (``on_request``) and each load (``touch``), as the connector's planner
tells it. With a ``RequestQueue`` (``Lookahead``) it also hears which requests wait at the
engine, so it keeps what they are about to load.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.replica.kvcache.policy import BlockRef, LRUPolicy, TierPolicy

CPU = int(Tier.CPU)


class CpuTier:
    """At most ``capacity_blocks`` blocks, managed by ``managed_by`` (LRU unless given)."""

    def __init__(self, capacity_blocks: int, managed_by: TierPolicy | None = None) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        managed_by = managed_by or TierPolicy(LRUPolicy())
        self.policy = managed_by.policy
        self.queue = managed_by.queue
        self._held: dict[BlockHash, None] = {}
        """Held blocks, in the order they entered (not the policy's order)."""
        self.rejected = 0
        """Blocks the policy did not admit (dropped on their way down from the engine tier)."""

    def __contains__(self, block: object) -> bool:
        return block in self._held

    def __len__(self) -> int:
        return len(self._held)

    def blocks(self) -> list[BlockHash]:
        return list(self._held)

    # ---- what the engine tells it ----------------------------------------------------------

    def arrived(self, request_id: Hashable, blocks: Sequence[BlockHash]) -> None:
        """A request with these prompt blocks waits at the engine (a queue hears of it)."""
        if self.queue is not None:
            self.queue.queued(request_id, blocks)

    def admitted(self, request_id: Hashable, refs: Sequence[BlockRef], category: str = "") -> None:
        """It runs now: the policy hears of its blocks' use (as the connector's planner tells
        it when vLLM schedules a request), and its wait is over."""
        self.policy.on_request(refs, category)
        self.left(request_id)

    def left(self, request_id: Hashable) -> None:
        """Its wait is over (it runs, or it left without running)."""
        if self.queue is not None:
            self.queue.started(request_id)

    def touch(self, refs: Sequence[BlockRef]) -> None:
        """``refs`` (one request's blocks, loaded back) were used: the held ones are recent."""
        held = [ref for ref in refs if ref.block in self._held]
        if held:
            self.policy.touch(CPU, held)

    def write(self, refs: Sequence[BlockRef]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Blocks the engine tier evicted, offered in order: returns (the ones now held that
        were not, the ones that left for them). A block offered and displaced within the call
        (a batch larger than the tier) is in neither list."""
        held, policy = self._held, self.policy
        added: dict[BlockHash, None] = {}
        dropped: list[BlockHash] = []
        for ref in refs:
            block = ref.block
            if block in held:
                policy.touch(CPU, (ref,))
                continue
            displaced = None
            if len(held) >= self.capacity_blocks:
                # Nothing pinned: the batch's own blocks are the most recent, and a lookahead
                # may rather drop one of them than a block a waiting request needs.
                displaced = policy.victim(CPU, ())
                if displaced is None:
                    self.rejected += 1
                    continue
            if not policy.admit(CPU, block, displaced):
                self.rejected += 1
                continue
            if displaced is not None:
                del held[displaced]
                policy.on_remove(CPU, displaced, True)
                if displaced in added:
                    del added[displaced]
                else:
                    dropped.append(displaced)
            held[block] = None
            policy.on_insert(CPU, ref)
            added[block] = None
        return list(added), dropped
