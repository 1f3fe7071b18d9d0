"""Belady's rule on a prefix tree: the offline reference every online policy is read against.

Offline: it is built with ``FutureUses``, for each request of one replay the index of the next
request whose prompt holds each block of its chain (computed once, before the replay, by the
caller: ``cache_sim.future_uses``). Its only time is the replay position: the ``n``-th
``on_request`` is request ``n``, so it reads no clock and a replay is deterministic. It cannot
run in a replica (no future there); it is not a ``kvcache.policy`` choice.

The rule, per tier: **evict, among the tier's leaves (blocks with no child in the same tier),
the one whose next use is furthest; ties go deepest first, then by hash.** Why leaves, and why
that loses nothing: a block is useful only with all its parents (a hit is a leading run), and
hashes are chained, so a block appears in a prompt only together with all its ancestors. Hence
next_use(parent) <= next_use(child) at every moment, and a block's *effective* next use (the
soonest use of it or anything under it, which is what evicting it gives up, since a block
dropped from every tier takes its subtree along) is its own next use. The block with the
furthest next use is therefore always available among the leaves (a child ties or beats its
parent, and the tie goes to the deeper block), and evicting leaves only never strands a child
behind an evicted parent. With hand-made, unchained traces the leaf rule still holds the prefix
invariant; the order among leaves is then plain Belady.

Lower tiers (exclusive, as the simulator keeps them; the policy is told their capacities): a
block evicted from tier t-1 is written to tier t if it is used again at all and it is not the
furthest of what tiers t and below could keep, i.e. one of them has room, or holds a block used
later than it (tier t's victim, or a deeper tier's, which the cascade of demotions reaches: each
displaced block goes one tier down under the same test). Otherwise it is dropped. "Later"
compares (next use, depth) as eviction does, so a block is always sooner than its own
descendants and never dropped in favour of them (dropping it would drop them too). The cascade
thus drops the furthest of the evicted block and the lower tiers' blocks (or nothing while
there is room), and the union of the tiers keeps the soonest-needed blocks, the engine tier the
soonest of those; a pairwise test (sooner than tier t's victim only) would drop a block that a
roomier deeper tier could keep. No promotion ahead of use: a hit counts the same in every tier,
so moving blocks up early cannot raise the hit rate.

A reference, not a proven optimum: the engine tier must hold every block of the running
request, a hit counts only a leading run, and tiers are exclusive, so exact optimality of the
greedy rule is not guaranteed (an online policy may, rarely, beat it on a size).

Cost: one lazily invalidated max-heap per tier. A block's entry is pushed when it enters a
tier, when a request moves its next use, and when it becomes a leaf; an entry is stale when
its generation is not the block's latest or the block left the tier or has a child there, and
is dropped when it reaches the top. Pinned blocks (the running request's) that reach the top
are set aside until the request ends (or a different pinned set is passed), so a request pays
for them once, not per eviction. The heaps are rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import cast

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.base import BlockRef, Promotion

NEVER = 1 << 62
"""The next-use index of a block no later request uses."""

_COMPACT_SLACK = 1024
"""A tier's heap is rebuilt when it holds more than twice its blocks plus this many entries."""

_Entry = tuple[int, int, BlockHash, int]
"""(-next use, -position, block, generation): the heap's top is the furthest, deepest block."""


@dataclass(frozen=True, slots=True)
class FutureUses:
    """What Belady knows in advance about one replay."""

    next_use: tuple[tuple[int, ...], ...]
    """``next_use[i][k]``: the index of the first request after request ``i`` whose prompt
    holds block ``k`` of request ``i``'s chain (prompt blocks, then answer blocks), or
    ``NEVER``."""

    def __len__(self) -> int:
        return len(self.next_use)


class BeladyPolicy:
    name = "belady"

    def __init__(self, future: FutureUses, capacity_blocks: Sequence[int]) -> None:
        """``capacity_blocks``: each tier's capacity, engine tier first (the admission test
        needs to know where a demoted block can still find room)."""
        self.future = future
        self.capacities = tuple(int(c) for c in capacity_blocks)
        self._request = 0
        self._next: dict[BlockHash, int] = {}
        self._position: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._tier_of: dict[BlockHash, int] = {}
        self._members: dict[int, set[BlockHash]] = {}
        self._children: dict[int, dict[BlockHash | None, int]] = {}
        """Per tier: how many of its blocks each block is the parent of."""
        self._heaps: dict[int, list[_Entry]] = {}
        self._gen: dict[BlockHash, int] = {}
        self._seq = 0
        self._stash: dict[int, list[_Entry]] = {}
        """Per tier: live entries of pinned blocks taken off the top, put back later."""
        self._stash_owner: object = None
        """The pinned set the stash was taken under."""

    # ---- state ---------------------------------------------------------------------------------

    def next_use(self, block: BlockHash) -> int:
        """The request index of ``block``'s next use as last told (``NEVER``: none)."""
        return self._next.get(block, NEVER)

    @property
    def requests_seen(self) -> int:
        return self._request

    # ---- events --------------------------------------------------------------------------------

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        index = self._request
        if index >= len(self.future):
            raise ValueError(f"request {index} is past the {len(self.future)} of the future")
        upcoming = self.future.next_use[index]
        if len(upcoming) != len(blocks):
            raise ValueError(
                f"request {index} has {len(blocks)} blocks, its future {len(upcoming)}: "
                "the replay is not the one the future was computed for"
            )
        self._request = index + 1
        self._unstash()
        tier_of = self._tier_of
        for ref, nxt in zip(blocks, upcoming, strict=True):
            self._next[ref.block] = nxt
            tier = tier_of.get(ref.block)
            if tier is not None:
                self._push(tier, ref.block)
        for tier in list(self._heaps):
            self._compact(tier)

    def on_insert(self, tier: int, block: BlockRef) -> None:
        b = block.block
        self._tier_of[b] = tier
        self._members.setdefault(tier, set()).add(b)
        self._position[b] = block.position
        self._parent[b] = block.parent
        self._children.setdefault(tier, {})
        children = self._children[tier]
        children[block.parent] = children.get(block.parent, 0) + 1
        self._push(tier, b)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        del self._tier_of[block]
        self._members[tier].discard(block)
        self._gen.pop(block, None)
        parent = self._parent[block]
        children = self._children[tier]
        left = children[parent] - 1
        if left:
            children[parent] = left
        else:
            del children[parent]
            if parent is not None and self._tier_of.get(parent) == tier:
                self._push(tier, parent)  # a leaf now: a candidate again
        if dropped:
            del self._parent[block]
            del self._position[block]
            self._next.pop(block, None)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        pass  # recency means nothing to an oracle

    # ---- decisions -----------------------------------------------------------------------------

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        if pinned is not self._stash_owner:
            self._unstash()
            self._stash_owner = pinned
        heap = self._heaps.get(tier)
        if not heap:
            return None
        children = self._children.get(tier, {})
        gen, tier_of = self._gen, self._tier_of
        while heap:
            entry = heap[0]
            block = entry[2]
            if gen.get(block) != entry[3] or tier_of.get(block) != tier or block in children:
                heapq.heappop(heap)  # stale, or not a leaf: re-pushed when it becomes one
                continue
            if block in pinned:
                self._stash.setdefault(tier, []).append(heapq.heappop(heap))
                continue
            return block
        return None

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        if self._next.get(block, NEVER) == NEVER:
            return False  # never used again: writing it buys nothing
        key = self._key(block)
        if displaced is None or key < self._key(displaced):
            return True
        # Later than tier's victim: still kept if a deeper tier has room or a later block.
        pinned = self._stash_owner if self._stash_owner is not None else ()
        for below in range(tier + 1, len(self.capacities)):
            capacity = self.capacities[below]
            if capacity <= 0:
                break  # the cascade stops at an empty tier
            if len(self._members.get(below, ())) < capacity:
                return True
            further = self.victim(below, cast(Container[BlockHash], pinned))
            if further is not None and key < self._key(further):
                return True
        return False

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return ()

    # ---- heaps ---------------------------------------------------------------------------------

    def _key(self, block: BlockHash) -> tuple[int, int]:
        """Eviction order, the greater first: next use, then depth (a child after its parent)."""
        return self._next.get(block, NEVER), self._position.get(block, 0)

    def _push(self, tier: int, block: BlockHash) -> None:
        self._seq += 1
        self._gen[block] = self._seq
        entry = (-self._next.get(block, NEVER), -self._position[block], block, self._seq)
        heapq.heappush(self._heaps.setdefault(tier, []), entry)

    def _unstash(self) -> None:
        for tier, entries in self._stash.items():
            heap = self._heaps[tier]
            for entry in entries:
                heapq.heappush(heap, entry)
        self._stash.clear()
        self._stash_owner = None

    def _compact(self, tier: int) -> None:
        """Rebuild ``tier``'s heap from its live leaves once stale entries dominate it."""
        heap = self._heaps[tier]
        members = self._members.get(tier, set())
        if len(heap) <= 2 * len(members) + _COMPACT_SLACK:
            return
        children = self._children.get(tier, {})
        fresh: list[_Entry] = []
        for block in members:
            if block in children:
                continue
            self._seq += 1
            self._gen[block] = self._seq
            fresh.append((-self._next.get(block, NEVER), -self._position[block], block, self._seq))
        heapq.heapify(fresh)
        self._heaps[tier] = fresh
