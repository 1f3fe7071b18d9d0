"""Lookahead (issue 18): what the cluster knows about the next requests, lent to any policy.

Requests that have arrived but not run (queued at the router, held at the replica, in the
engine's waiting queue) name the blocks they are about to use, and in which order. Belady's
rule is to evict the block used furthest in the future; for the queued requests' blocks that
future is known. ``Lookahead`` wraps a policy:

1. the victim is the wrapped policy's choice among the blocks no queued request needs;
2. when every candidate is needed, it is the one whose first queued use is furthest (Belady's
   rule over the queue; among equals the deepest, which never strands a child);
3. a needed block that has to leave a tier is written to the next one whatever the wrapped
   policy's admission says (it is about to be loaded), unless the block it would displace is
   needed sooner.

Nothing is pinned: a queue longer than the cache only orders the evictions. Bounded in work:
at most ``max_queued`` requests are tracked (later ones are ignored until earlier ones start).
A queued request's held blocks are marked used when it arrives, so the wrapped policy's scan,
which starts at its least recent blocks, seldom meets a needed one; an eviction then costs
the wrapped policy's plus, in case 2, a heap pop (docs/BENCHMARKS.md: the cost per eviction).

Pure like every policy: the cache that owns the queue calls ``queued`` when a request arrives
and ``started`` when it runs (or leaves); the rest is the wrapped policy's ``CachePolicy``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Container, Hashable, Sequence
from typing import Protocol

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.base import BlockRef, CachePolicy, Promotion

DEFAULT_MAX_QUEUED = 1024
"""Queued requests tracked at once."""


class RequestQueue(Protocol):
    """What a cache tells a policy about requests that have arrived but not run."""

    def queued(self, request_id: Hashable, blocks: Sequence[BlockHash]) -> None: ...

    def started(self, request_id: Hashable) -> None:
        """It runs now (its blocks are about to be placed) or left the queue."""
        ...


class _Excluded:
    """``pinned`` or needed by a queued request: what the wrapped policy must not pick."""

    __slots__ = ("_needed", "_pinned")

    def __init__(self, pinned: Container[BlockHash], needed: Container[BlockHash]) -> None:
        self._pinned = pinned
        self._needed = needed

    def __contains__(self, block: object) -> bool:
        return block in self._pinned or block in self._needed


class Lookahead:
    """``policy``, with the queued requests' blocks kept, nearest use last to go."""

    def __init__(self, policy: CachePolicy, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.policy = policy
        self.name = f"{policy.name}+lookahead"
        self.max_queued = max_queued
        self._requests: dict[Hashable, tuple[int, tuple[BlockHash, ...]]] = {}
        """Queued request -> (arrival sequence number, its distinct blocks)."""
        self._sequence = 0
        self._uses: dict[BlockHash, list[int]] = {}
        """Needed block -> sequence numbers of the queued requests needing it, ascending."""
        self._tier_of: dict[BlockHash, int] = {}
        self._depth: dict[BlockHash, int] = {}
        self._heaps: dict[int, list[tuple[int, int, BlockHash]]] = {}
        """Per tier, (-first use, -depth, block) of needed blocks; stale entries are skipped."""
        self._resident: dict[int, int] = {}
        """Per tier, blocks held."""
        self._needed_resident: dict[int, int] = {}
        """Per tier, needed blocks held: when they are all, the wrapped policy is not asked."""

    # ---- the queue ---------------------------------------------------------------------------

    @property
    def queued_requests(self) -> int:
        return len(self._requests)

    def needed(self, block: BlockHash) -> bool:
        return block in self._uses

    def first_use(self, block: BlockHash) -> int | None:
        """Sequence number of the earliest queued request needing ``block``."""
        uses = self._uses.get(block)
        return uses[0] if uses else None

    def queued(self, request_id: Hashable, blocks: Sequence[BlockHash]) -> None:
        if request_id in self._requests or len(self._requests) >= self.max_queued:
            return
        sequence = self._sequence
        self._sequence += 1
        distinct = tuple(dict.fromkeys(blocks))
        self._requests[request_id] = (sequence, distinct)
        held: dict[int, list[BlockRef]] = {}
        for block in distinct:
            uses = self._uses.get(block)
            tier = self._tier_of.get(block)
            if uses is None:
                self._uses[block] = [sequence]
                self._push(block)
                if tier is not None:
                    self._needed_resident[tier] += 1
            else:
                uses.append(sequence)  # the newest request: its number is the largest
            if tier is not None:
                held.setdefault(tier, []).append(BlockRef(block, None, self._depth[block]))
        # Marked used now: the wrapped policy's scan for a victim starts at its least recent
        # blocks, which would otherwise fill up with needed ones it has to skip each time.
        # Their order among the rest changes nothing: the run touches them again.
        for tier, refs in held.items():
            self.policy.touch(tier, refs)

    def started(self, request_id: Hashable) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        sequence, blocks = entry
        for block in blocks:
            uses = self._uses[block]
            first = uses[0]
            del uses[bisect_left(uses, sequence)]
            if not uses:
                del self._uses[block]
                tier = self._tier_of.get(block)
                if tier is not None:
                    self._needed_resident[tier] -= 1
            elif uses[0] != first:
                self._push(block)

    def _push(self, block: BlockHash) -> None:
        tier = self._tier_of.get(block)
        if tier is None:
            return
        heap = self._heaps.setdefault(tier, [])
        if len(heap) > 2 * len(self._uses) + 1024:  # mostly stale: rebuild from the live ones
            heap[:] = [
                (-uses[0], -self._depth[b], b)
                for b, uses in self._uses.items()
                if self._tier_of.get(b) == tier
            ]
            heapq.heapify(heap)
            return  # ``block`` is among them
        heapq.heappush(heap, (-self._uses[block][0], -self._depth[block], block))

    def _furthest(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        """The needed block of ``tier`` first used furthest ahead (deepest among equals)."""
        heap = self._heaps.get(tier)
        if not heap:
            return None
        skipped = []
        found = None
        while heap:
            negative_use, _, block = heap[0]
            uses = self._uses.get(block)
            if uses is None or uses[0] != -negative_use or self._tier_of.get(block) != tier:
                heapq.heappop(heap)  # stale: no longer needed, needed sooner, or moved
                continue
            if block in pinned:
                skipped.append(heapq.heappop(heap))
                continue
            found = block
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    # ---- the policy --------------------------------------------------------------------------

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        self.policy.on_request(blocks, category)

    def on_insert(self, tier: int, block: BlockRef) -> None:
        self._tier_of[block.block] = tier
        self._depth[block.block] = block.position
        self._resident[tier] = self._resident.get(tier, 0) + 1
        self._needed_resident.setdefault(tier, 0)
        if block.block in self._uses:
            self._needed_resident[tier] += 1
            self._push(block.block)
        self.policy.on_insert(tier, block)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        del self._tier_of[block]
        del self._depth[block]
        self._resident[tier] -= 1
        if block in self._uses:
            self._needed_resident[tier] -= 1
        self.policy.on_remove(tier, block, dropped)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        self.policy.touch(tier, blocks)

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        if not self._uses:
            return self.policy.victim(tier, pinned)
        if self._needed_resident.get(tier, 0) < self._resident.get(tier, 0):
            victim = self.policy.victim(tier, _Excluded(pinned, self._uses))
            if victim is not None:
                return victim
        return self._furthest(tier, pinned)

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        uses = self._uses.get(block)
        if uses is not None:
            theirs = None if displaced is None else self._uses.get(displaced)
            if theirs is None or theirs[0] > uses[0]:
                return True
        return self.policy.admit(tier, block, displaced)

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return self.policy.promotions(_Excluded(pinned, self._uses))
