"""The cache simulator: a multi-tier prefix cache, simulated. Prompts as chained block hashes
are replayed through a ``CachePolicy`` (pure: no I/O, no KV, time from the requests).

Tiers: 0 is the engine's own cache, then the lower tiers (CPU memory, disk), each with a
capacity in blocks. A block lives in one tier at a time (exclusive, as HotPrefix's tree and the
GPU-to-CPU swap of seed-003 keep it). For each request:

1. Hit: the longest leading run of its blocks that some tier holds, counted per tier. The tiers
   hold only whole chains (a block's parent is always held), so the run ends at the first
   block no tier holds.
2. Placement, first block to last: a block a lower tier holds moves up to the engine tier (a
   load when it is part of the hit; past the hit it is recomputed); a block nobody holds is
   computed and stored there. Making room evicts the policy's victim, never one of the
   request's own blocks; a request longer than the engine tier keeps only what fits.
3. An evicted block goes to the next tier if that tier has room or the policy admits it over
   the block it would displace (which goes down in turn); otherwise it is dropped. A block
   dropped from every tier takes the blocks under it with it (unreachable by prefix match).
4. The policy may then promote lower-tier blocks into the engine tier, dropping colder engine
   blocks for them (HotPrefix).

``future_uses`` computes, before a replay, what the offline ``belady`` reference policy knows
about it (each block's next use), so that the policy's eviction path only reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.base import (
    ENGINE_TIER,
    BlockRef,
    CachePolicy,
    ManualClock,
    chain_refs,
)
from prefixmesh.replica.kvcache.policy.belady import NEVER, FutureUses
from prefixmesh.replica.kvcache.policy.lookahead import RequestQueue


@dataclass(frozen=True, slots=True)
class CacheRequest:
    blocks: tuple[BlockHash, ...]
    """The chained hashes of the prompt's full blocks."""
    time_s: float = 0.0
    category: str = ""
    """Request category for the workload-aware policy (type and turn, e.g. ``text-2``)."""
    output_blocks: tuple[BlockHash, ...] = ()
    """Blocks of its answer that a later prompt repeats (multi-turn): stored after the prompt,
    never counted as requested or hit."""


@dataclass(frozen=True, slots=True)
class CacheSimResult:
    policy: str
    capacity_blocks: tuple[int, ...]
    requests: int
    blocks: int
    """Full blocks requested."""
    hits_by_tier: tuple[int, ...]
    """Leading-prefix hit blocks, by the tier that held them."""
    blocks_written_by_tier: tuple[int, ...]
    """Blocks written into each tier from the one above (0 for the engine tier)."""
    blocks_evicted: int
    """Blocks evicted from the engine tier for room (writing all of them is the baseline)."""
    blocks_rejected: int
    """Evicted blocks the policy did not admit to the next tier (dropped)."""
    blocks_loaded: int
    """Lower-tier hits moved up into the engine tier."""
    blocks_promoted_ahead: int
    """Lower-tier blocks the policy promoted ahead of use."""
    blocks_dropped_orphans: int
    """Blocks dropped because a block before them left every tier."""

    @property
    def hits(self) -> int:
        return sum(self.hits_by_tier)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_by_tier(self) -> tuple[float, ...]:
        return tuple(h / self.blocks if self.blocks else 0.0 for h in self.hits_by_tier)

    @property
    def blocks_written(self) -> int:
        return sum(self.blocks_written_by_tier)

    @property
    def blocks_promoted(self) -> int:
        """Every block moved up into the engine tier: loads on hit and promotions."""
        return self.blocks_loaded + self.blocks_promoted_ahead


def future_uses(requests: Sequence[CacheRequest]) -> FutureUses:
    """For each request, the index of the next request whose prompt holds each block of its
    chain (prompt, then answer blocks), ``NEVER`` when none does: one backward pass. Answer
    blocks are stored but not requested, so only prompts count as uses."""
    upcoming: dict[BlockHash, int] = {}
    out: list[tuple[int, ...]] = [()] * len(requests)
    for index in range(len(requests) - 1, -1, -1):
        request = requests[index]
        chain = request.blocks + request.output_blocks if request.output_blocks else request.blocks
        out[index] = tuple(upcoming.get(block, NEVER) for block in chain)
        for block in request.blocks:
            upcoming[block] = index
    return FutureUses(tuple(out))


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    blocks: int = 0
    hits: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    evicted: int = 0
    rejected: int = 0
    loaded: int = 0
    promoted: int = 0
    orphans: int = 0


class TieredCacheSim:
    """One replica's tiers under one policy; ``access`` replays a request."""

    def __init__(
        self,
        capacities: Sequence[int],
        policy: CachePolicy,
        clock: ManualClock | None = None,
    ) -> None:
        if not capacities or capacities[0] <= 0 or any(c < 0 for c in capacities):
            raise ValueError(f"need an engine tier > 0 and lower tiers >= 0, got {capacities}")
        self.capacities = tuple(int(c) for c in capacities)
        self.policy = policy
        self.clock = clock
        self._tier_of: dict[BlockHash, int] = {}
        self._size = [0] * len(self.capacities)
        self._ref: dict[BlockHash, BlockRef] = {}
        self._children: dict[BlockHash | None, set[BlockHash]] = {}
        n = len(self.capacities)
        self._c = _Counters(hits=[0] * n, written=[0] * n)

    # ---- state ---------------------------------------------------------------------------------

    def tier_of(self, block: BlockHash) -> int | None:
        return self._tier_of.get(block)

    def blocks_in(self, tier: int) -> list[BlockHash]:
        return [b for b, t in self._tier_of.items() if t == tier]

    def size(self, tier: int) -> int:
        return self._size[tier]

    def result(self) -> CacheSimResult:
        c = self._c
        return CacheSimResult(
            policy=self.policy.name,
            capacity_blocks=self.capacities,
            requests=c.requests,
            blocks=c.blocks,
            hits_by_tier=tuple(c.hits),
            blocks_written_by_tier=tuple(c.written),
            blocks_evicted=c.evicted,
            blocks_rejected=c.rejected,
            blocks_loaded=c.loaded,
            blocks_promoted_ahead=c.promoted,
            blocks_dropped_orphans=c.orphans,
        )

    # ---- requests ------------------------------------------------------------------------------

    def run(
        self,
        requests: Iterable[CacheRequest],
        queue: RequestQueue | None = None,
        lookahead: int = 0,
    ) -> CacheSimResult:
        """Replay ``requests`` in order. With ``queue``, the ``lookahead`` requests after the
        one running are reported queued to it (a backlog of that many at the router and in the
        engine's waiting queue); a request is reported started just before it runs."""
        if queue is None or lookahead <= 0:
            for request in requests:
                self.access(request)
            return self.result()
        replay = list(requests)
        next_queued = 0
        for index, request in enumerate(replay):
            while next_queued < len(replay) and next_queued <= index + lookahead:
                queue.queued(next_queued, replay[next_queued].blocks)
                next_queued += 1
            queue.started(index)
            self.access(request)
        return self.result()

    def access(self, request: CacheRequest) -> tuple[int, ...]:
        """Replay one request; returns its hit blocks per tier."""
        if self.clock is not None:
            self.clock.set(request.time_s)
        blocks = request.blocks
        chain = blocks + request.output_blocks if request.output_blocks else blocks
        refs = chain_refs(chain)
        hits = [0] * len(self.capacities)
        tier_of = self._tier_of
        run = 0
        for block in blocks:
            tier = tier_of.get(block)
            if tier is None:
                break
            hits[tier] += 1
            run += 1
        c = self._c
        c.requests += 1
        c.blocks += len(blocks)
        for tier, count in enumerate(hits):
            c.hits[tier] += count

        self.policy.on_request(refs, request.category)
        pinned = set(chain)
        engine_capacity = self.capacities[ENGINE_TIER]
        for ref in refs:
            tier = tier_of.get(ref.block)
            if tier == ENGINE_TIER:
                continue
            if (
                self._size[ENGINE_TIER] >= engine_capacity
                and self.policy.victim(ENGINE_TIER, pinned) is None
            ):
                break  # the engine tier is all this request's: the rest is not kept there
            if tier is not None:
                # Out of its tier first: the engine block it displaces may take its place.
                self._remove(tier, ref.block, dropped=False)
                if ref.position < run:
                    c.loaded += 1
            self._make_room(ENGINE_TIER, pinned)
            self._insert(ENGINE_TIER, ref)
        self.policy.touch(ENGINE_TIER, [r for r in refs if tier_of.get(r.block) == ENGINE_TIER])
        self._promote()
        return tuple(hits)

    # ---- moves ---------------------------------------------------------------------------------

    def _insert(self, tier: int, ref: BlockRef) -> None:
        self._tier_of[ref.block] = tier
        self._size[tier] += 1
        self._ref[ref.block] = ref
        self._children.setdefault(ref.parent, set()).add(ref.block)
        self.policy.on_insert(tier, ref)

    def _remove(self, tier: int, block: BlockHash, dropped: bool) -> BlockRef:
        del self._tier_of[block]
        self._size[tier] -= 1
        ref = self._ref.pop(block)
        siblings = self._children[ref.parent]
        siblings.discard(block)
        if not siblings:
            del self._children[ref.parent]
        self.policy.on_remove(tier, block, dropped)
        return ref

    def _drop(self, tier: int, block: BlockHash) -> None:
        """Drop ``block`` from every tier, and every block under it."""
        self._remove(tier, block, dropped=True)
        stack = list(self._children.get(block, ()))
        while stack:
            child = stack.pop()
            self._remove(self._tier_of[child], child, dropped=True)
            self._c.orphans += 1
            stack.extend(self._children.get(child, ()))

    def _make_room(self, tier: int, pinned: set[BlockHash]) -> bool:
        while self._size[tier] >= self.capacities[tier]:
            victim = self.policy.victim(tier, pinned)
            if victim is None:
                return False
            self._evict(tier, victim, pinned)
        return True

    def _evict(self, tier: int, block: BlockHash, pinned: set[BlockHash]) -> None:
        if tier == ENGINE_TIER:
            self._c.evicted += 1
        below = tier + 1
        if below < len(self.capacities) and self.capacities[below] > 0:
            full = self._size[below] >= self.capacities[below]
            displaced = self.policy.victim(below, pinned) if full else None
            if not full or displaced is not None:  # else: all pinned, nothing can go down
                if self.policy.admit(below, block, displaced):
                    ref = self._remove(tier, block, dropped=False)
                    if displaced is not None:
                        self._evict(below, displaced, pinned)
                    self._insert(below, ref)
                    self._c.written[below] += 1
                    return
                self._c.rejected += 1
        self._drop(tier, block)

    def _promote(self) -> None:
        for plan in self.policy.promotions(()):
            tier = self._tier_of.get(plan.block)
            if tier is None or tier != plan.from_tier or tier == ENGINE_TIER:
                continue
            parent = self._ref[plan.block].parent
            if parent is not None and self._tier_of.get(parent) != ENGINE_TIER:
                continue
            victims = [
                v for v in plan.victims if self._tier_of.get(v) == ENGINE_TIER and v != parent
            ]
            free = self.capacities[ENGINE_TIER] - self._size[ENGINE_TIER]
            if free + len(victims) < 1:
                continue
            # Out of its tier first, so that a demoted victim finds the room it leaves.
            ref = self._remove(tier, plan.block, dropped=False)
            keep = {plan.block} if parent is None else {plan.block, parent}
            for victim in victims:
                if self._tier_of.get(victim) != ENGINE_TIER:
                    continue  # went with an earlier victim
                if plan.drop_victims:
                    self._drop(ENGINE_TIER, victim)
                else:
                    self._evict(ENGINE_TIER, victim, keep)
            self._insert(ENGINE_TIER, ref)
            self._c.promoted += 1
