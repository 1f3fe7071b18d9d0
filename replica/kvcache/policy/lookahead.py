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
A needed block the wrapped policy's scan passes over (its least recent blocks, where a
waiting request's blocks drift while it waits) is marked used then, so the next scans do not
meet it again; an eviction costs the wrapped policy's plus, in case 2, a heap pop
(docs/benchmarks-log.md: the cost per eviction).

Pure like every policy: the cache that owns the queue calls ``queued`` when a request arrives
and ``started`` when it runs (or leaves); the rest is the wrapped policy's ``CachePolicy``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Container, Hashable, Sequence
from typing import Protocol, cast

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.base import BlockRef, CachePolicy, Promotion, deepest_first

DEFAULT_MAX_QUEUED = 1024
"""Queued requests tracked at once."""


class RequestQueue(Protocol):
    """What a cache tells a policy about requests that have arrived but not run."""

    def queued(self, request_id: Hashable, blocks: Sequence[BlockHash]) -> None: ...

    def started(self, request_id: Hashable) -> None:
        """It runs now (its blocks are about to be placed) or left the queue."""
        ...


SCAN_LIMIT = 64
"""Blocks (needed or pinned) the wrapped policy's scan may pass over in one eviction; past
that, the least recently used unneeded block goes instead of the wrapped policy's pick."""


MOSTLY_NEEDED = 4
"""When fewer than 1 in this many held blocks are unneeded, the wrapped policy is not asked:
the least recently used unneeded block goes (its scan would cost up to ``SCAN_LIMIT``)."""


class _LongScan(Exception):
    """The wrapped policy's scan met more than ``SCAN_LIMIT`` needed blocks."""


class _Excluded:
    """``pinned`` or needed by a queued request: what the wrapped policy must not pick. The
    needed blocks it was asked about are kept in ``met``; past ``limit`` blocks excluded, the
    scan is cut short (``_LongScan``)."""

    __slots__ = ("_limit", "_needed", "_passed", "_pinned", "met")

    def __init__(
        self, pinned: Container[BlockHash], needed: Container[BlockHash], limit: int
    ) -> None:
        self._pinned = pinned
        self._needed = needed
        self._limit = limit
        self._passed = 0
        self.met: list[BlockHash] = []

    def __contains__(self, block: object) -> bool:
        if block in self._pinned:
            self._passed += 1
        elif block in self._needed:
            self.met.append(cast(BlockHash, block))  # a needed block is a block hash
            self._passed += 1
        else:
            return False
        if self._passed > self._limit:
            raise _LongScan
        return True


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
        self._unneeded: dict[int, dict[BlockHash, None]] = {}
        """Per tier, the blocks held that no queued request needs, least recently used first
        (the fallback when the wrapped policy's scan runs long)."""

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
        # Nothing is marked used here: a wait is not a use, and where the run does not touch
        # every block again (a CPU tier hears only of its loads) that would reorder the rest.
        for block in distinct:
            uses = self._uses.get(block)
            tier = self._tier_of.get(block)
            if uses is None:
                self._uses[block] = [sequence]
                self._push(block)
                if tier is not None:
                    del self._unneeded[tier][block]
            else:
                uses.append(sequence)  # the newest request: its number is the largest

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
                    self._unneeded[tier][block] = None  # used now: the most recent
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
        """The needed block of ``tier`` first used furthest ahead (deepest among equals); None
        when the ``SCAN_LIMIT`` furthest are all pinned (the running request's own blocks,
        which the queue needs too: nothing goes rather than a scan through all of them)."""
        heap = self._heaps.get(tier)
        if not heap:
            return None
        skipped: list[tuple[int, int, BlockHash]] = []
        found = None
        while heap and len(skipped) <= SCAN_LIMIT:
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
        unneeded = self._unneeded.setdefault(tier, {})
        if block.block in self._uses:
            self._push(block.block)
        else:
            unneeded[block.block] = None
        self.policy.on_insert(tier, block)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        del self._tier_of[block]
        del self._depth[block]
        self._resident[tier] -= 1
        if block not in self._uses:
            del self._unneeded[tier][block]
        self.policy.on_remove(tier, block, dropped)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        unneeded = self._unneeded.get(tier)
        if unneeded:
            for ref in deepest_first(blocks):
                if unneeded.pop(ref.block, 0) is None:
                    unneeded[ref.block] = None
        self.policy.touch(tier, blocks)

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        if not self._uses:
            return self.policy.victim(tier, pinned)
        unneeded = self._unneeded.get(tier)
        if unneeded and len(unneeded) * MOSTLY_NEEDED < self._resident[tier]:
            # Mostly needed blocks: the wrapped policy's scan would mostly meet those; the
            # least recently used unneeded block goes.
            victim = next((b for b in unneeded if b not in pinned), None)
            return victim if victim is not None else self._furthest(tier, pinned)
        if unneeded:
            excluded = _Excluded(pinned, self._uses, SCAN_LIMIT)
            try:
                victim = self.policy.victim(tier, excluded)
            except _LongScan:  # its candidates are mostly excluded: the oldest unneeded goes
                victim = next((b for b in unneeded if b not in pinned), None)
            if excluded.met:
                # Needed blocks the scan had to pass over are marked used, so that the next
                # scans do not meet them again (a queue's blocks age while it waits): they
                # would have been kept anyway, and the scan stays short.
                tier_of, depth = self._tier_of, self._depth
                met = {b: None for b in excluded.met if tier_of.get(b) == tier}
                self.policy.touch(tier, [BlockRef(b, None, depth[b]) for b in met])
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
        return self.policy.promotions(_Excluded(pinned, self._uses, len(self._uses)))
