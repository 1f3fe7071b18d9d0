"""The engine-tier block cache of one replica, with an optional CPU tier: bookkeeping only.

Blocks are counted, not placed: the cache knows how many blocks are allocated, which hashes are
cached, who references them, and in which order unreferenced ones are evicted. That is all a
routing experiment needs, and it keeps admission O(blocks of the request).

Engine tier (vLLM's prefix cache semantics):
  - a cached block has a hash and a reference count; running requests reference the blocks they
    hit or stored; a block nobody references stays cached but is evictable;
  - evictable blocks leave in LRU order; a request's blocks are released tail first, so within one
    prompt the last block is evicted first (vLLM's free queue does the same);
  - a private block is allocated to a running request without a cached hash: a block still being
    prefilled, the reservation for the output, a partial last block, or a duplicate of a block
    another request stored first (vLLM keeps such duplicates too);
  - capacity = cached blocks + private blocks + free blocks.

CPU tier (optional): a ``CpuTier``, evicted and admitted by a cache policy (LRU by default, or
the KV connector's configured one, with lookahead when it is told the waiting requests). A block
evicted from the engine tier is offered to it; a hit there is loaded back into an engine block
(the CPU copy stays, as a write-through copy).

Shared tier (optional): one ``SharedTier`` for the whole cluster (a disk directory every replica
reads, in a real cluster): a block is written to it once, by whichever replica computed it, and
any replica loads it from there; an LRU of hashes, evicted by one policy for the cluster.

Every change of what is held leaves as a ``CacheChange`` (stored/removed, with tier), to be
published to the registry as ``CacheEvent``s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

from prefixmesh.cache_registry.types import BlockHash, CacheEvent, EventKind, ReplicaId, Tier
from prefixmesh.replica.kvcache.policy import TierPolicy
from prefixmesh.replica.kvcache.policy.base import BlockRef, chain_refs
from prefixmesh.replica.sim_model.cpu_tier import CpuTier


@dataclass(frozen=True, slots=True)
class CacheChange:
    """Blocks that became held (stored) or stopped being held (removed) in one tier."""

    kind: EventKind
    tier: Tier
    block_hashes: tuple[BlockHash, ...]


def to_events(
    changes: Sequence[CacheChange], replica_id: ReplicaId, first_seq: int, epoch: int = 0
) -> list[CacheEvent]:
    """Sequence-numbered registry events for ``changes`` (seq ``first_seq`` onwards)."""
    return [
        CacheEvent(change.kind, replica_id, first_seq + i, epoch, change.tier, change.block_hashes)
        for i, change in enumerate(changes)
    ]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    num_blocks: int
    """Leading blocks held in some tier."""
    num_cpu_blocks: int = 0
    """Of those, the blocks held only in the CPU tier (to be loaded back)."""
    num_shared_blocks: int = 0
    """Of those, the blocks held only in the cluster's shared tier (to be loaded from it)."""


class SharedTier:
    """The cluster's shared tier: block hashes in LRU order, ``capacity_blocks`` at most. Its
    changes are the cluster's, published once (not per replica)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._changes: list[CacheChange] = []

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            self._blocks.move_to_end(block)

    def write(self, blocks: Sequence[BlockHash]) -> None:
        """Blocks a replica just computed; the ones already there only become recent."""
        held = self._blocks
        added = [block for block in blocks if block not in held]
        for block in blocks:
            held[block] = None
            held.move_to_end(block)
        dropped: list[BlockHash] = []
        while len(held) > self.capacity_blocks:
            dropped.append(held.popitem(last=False)[0])
        if dropped and added:  # written and dropped within one batch: never held
            new = set(added)
            dropped = [b for b in dropped if b not in new]
            added = [b for b in added if b in held]
        if added:
            self._changes.append(CacheChange(EventKind.STORED, Tier.DISK, tuple(added)))
        if dropped:
            self._changes.append(CacheChange(EventKind.REMOVED, Tier.DISK, tuple(dropped)))

    def take_changes(self) -> list[CacheChange]:
        changes, self._changes = self._changes, []
        return changes


class PrefixCache:
    """Engine-tier blocks with reference counts and LRU eviction, plus an optional CPU tier
    (``cpu_blocks`` of them, managed by ``cpu_policy``: LRU unless given)."""

    def __init__(
        self,
        capacity_blocks: int,
        cpu_blocks: int = 0,
        shared: SharedTier | None = None,
        *,
        cpu_policy: TierPolicy | None = None,
    ) -> None:
        if capacity_blocks <= 0 or cpu_blocks < 0:
            raise ValueError("capacity_blocks must be > 0 and cpu_blocks >= 0")
        self.capacity_blocks = capacity_blocks
        self.cpu_capacity_blocks = cpu_blocks
        self.shared = shared
        """The cluster's shared tier, if it has one (the same object in every replica)."""
        self._refs: dict[BlockHash, int] = {}
        """Cached engine-tier blocks -> number of running requests referencing them."""
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()
        """Cached blocks with no reference, first to be evicted first."""
        self.cpu = CpuTier(cpu_blocks, cpu_policy) if cpu_blocks else None
        self._cpu: CpuTier | frozenset[BlockHash] = frozenset() if self.cpu is None else self.cpu
        self._chain: dict[BlockHash, BlockRef] = {}
        """Engine-tier blocks' places in their chains, kept only with a CPU tier (its policy
        is told where an evicted block sat)."""
        self._private = 0
        self._changes: list[CacheChange] = []

    # ---- state -----------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_private(self) -> int:
        return self._private

    @property
    def num_free(self) -> int:
        return self.capacity_blocks - len(self._refs) - self._private

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def eviction_order(self) -> list[BlockHash]:
        """Evictable engine-tier blocks, next to be evicted first."""
        return list(self._evictable)

    def cpu_blocks(self) -> list[BlockHash]:
        """CPU-tier blocks, in the order they entered it."""
        return self.cpu.blocks() if self.cpu is not None else []

    def cached_blocks(self) -> list[BlockHash]:
        """Every engine-tier block with a hash (referenced or evictable)."""
        return list(self._refs)

    def clear_evictable(self) -> list[BlockHash]:
        """Drop every unreferenced engine-tier block (a prefix-cache reset; running requests
        keep theirs, as vLLM's reset does); returns them, recorded as removed."""
        dropped = list(self._evictable)
        for block in dropped:
            del self._refs[block]
            self._chain.pop(block, None)
        self._evictable.clear()
        if dropped:
            self._changes.append(CacheChange(EventKind.REMOVED, Tier.GPU, tuple(dropped)))
        return dropped

    def holds(self, block: BlockHash) -> Tier | None:
        """The fastest tier holding ``block`` (None when neither does)."""
        if block in self._refs:
            return Tier.GPU
        return Tier.CPU if block in self._cpu else None

    def take_changes(self) -> list[CacheChange]:
        """The changes since the last call, oldest first."""
        changes, self._changes = self._changes, []
        return changes

    # ---- requests --------------------------------------------------------------------------

    def arrived(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """A request with these prompt blocks waits to run (the CPU tier's queue hears it)."""
        if self.cpu is not None:
            self.cpu.arrived(request_id, hashes)

    def admitted(self, request_id: str, hashes: Sequence[BlockHash]) -> None:
        """It runs now (its blocks were acquired): the CPU tier's policy hears of the use."""
        if self.cpu is not None:
            self.cpu.admitted(request_id, chain_refs(hashes))

    def left(self, request_id: str) -> None:
        """It left without running."""
        if self.cpu is not None:
            self.cpu.left(request_id)

    def match(self, hashes: Sequence[BlockHash], max_blocks: int) -> PrefixMatch:
        """Leading blocks of ``hashes`` (at most ``max_blocks``) held in the engine tier, the
        CPU tier or the shared tier."""
        limit = max(0, min(max_blocks, len(hashes)))
        # NOTE: iterate in C (takewhile over dict.__contains__): this runs twice per request.
        num_gpu = len(list(takewhile(self._refs.__contains__, islice(hashes, limit))))
        shared = self.shared
        if num_gpu == limit or not (self._cpu or shared):
            return PrefixMatch(num_gpu)
        refs, cpu = self._refs, self._cpu
        num_cpu = num_shared = 0
        for i in range(num_gpu, limit):
            block = hashes[i]
            if block in refs:
                continue
            if block in cpu:
                num_cpu += 1
                continue
            if shared is not None and block in shared:
                num_shared += 1
                continue
            return PrefixMatch(i, num_cpu, num_shared)
        return PrefixMatch(limit, num_cpu, num_shared)

    def fits(self, hashes: Sequence[BlockHash], num_hit: int, num_private: int) -> bool:
        """Whether ``acquire`` would succeed now (changes nothing)."""
        return self._fits(list(map(self._refs.get, hashes[:num_hit])), num_private)

    def _fits(self, counts: list[int | None], num_private: int) -> bool:
        # Blocks to load (not in the engine) and private ones, against the free blocks and the
        # evictable ones this request does not pin itself.
        needed = counts.count(None) + num_private
        return needed <= self.num_free + len(self._evictable) - counts.count(0)

    def acquire(self, hashes: Sequence[BlockHash], num_hit: int, num_private: int) -> bool:
        """Reference the first ``num_hit`` blocks of ``hashes`` (as matched: CPU-only ones are
        loaded into engine blocks) and allocate ``num_private`` private blocks, evicting as
        needed. Returns False, changing nothing, when the blocks do not fit."""
        refs = self._refs
        hit = hashes[:num_hit]
        counts = list(map(refs.get, hit))
        if not self._fits(counts, num_private):
            return False
        to_load = (
            [b for b, c in zip(hit, counts, strict=True) if c is None] if None in counts else []
        )
        needed = len(to_load) + num_private
        evictable = self._evictable
        for block in hit:
            count = refs.get(block)
            if count is not None:
                if count == 0:
                    del evictable[block]
                refs[block] = count + 1
        if to_load:  # the loaded copies are the most recently used
            loading = set(to_load)
            loaded = [ref for ref in chain_refs(hit) if ref.block in loading]
            if self.cpu is not None:
                self.cpu.touch(loaded)
                self._chain.update((ref.block, ref) for ref in loaded)
            if self.shared is not None:
                self.shared.touch([block for block in to_load if block not in self._cpu])
        self._make_room(needed)
        for block in to_load:
            refs[block] = 1
        if to_load:
            self._changes.append(CacheChange(EventKind.STORED, Tier.GPU, tuple(to_load)))
        self._private += num_private
        return True

    def promote(self, hashes: Sequence[BlockHash], max_blocks: int, limit: int) -> int:
        """Read up to ``limit`` of the shared-tier blocks among the leading blocks of
        ``hashes`` (at most ``max_blocks``) that some tier holds into the CPU tier, as the KV
        connector promotes a waiting request's blocks ahead of its turn. Returns how many the
        CPU tier took."""
        cpu, shared = self.cpu, self.shared
        if cpu is None or shared is None or limit <= 0:
            return 0
        refs = chain_refs(hashes[: max(0, min(max_blocks, len(hashes)))])
        wanted = []
        for ref in refs:
            block = ref.block
            if block in self._refs or block in cpu:
                continue
            if block not in shared:
                break
            wanted.append(ref)
            if len(wanted) >= limit:
                break
        if not wanted:
            return 0
        return self._write_cpu(cpu, wanted)

    def store(self, hashes: Sequence[BlockHash], start: int = 0) -> list[BlockHash]:
        """A running request finished computing ``hashes[start:]`` (the earlier ones are its
        hit) in its private blocks: cache them.

        Returns the hashes it now references (its copies became the cached ones); a block some
        other request cached first stays private to this request and is freed at release."""
        refs = self._refs
        stored = [block for block in hashes[start:] if block not in refs]
        if len(set(stored)) != len(stored):
            raise ValueError("a prompt cannot hold the same block hash twice")
        if len(stored) > self._private:
            raise ValueError(f"storing {len(stored)} blocks but only {self._private} private")
        for block in stored:
            refs[block] = 1
        if self.cpu is not None and stored:
            new = set(stored)
            self._chain.update((r.block, r) for r in chain_refs(hashes, start) if r.block in new)
        self._private -= len(stored)
        if stored:
            self._changes.append(CacheChange(EventKind.STORED, Tier.GPU, tuple(stored)))
            if self.shared is not None:  # written once, by the replica that computed it
                self.shared.write(stored)
        return stored

    def release(self, held: Sequence[BlockHash], num_private: int) -> None:
        """A request is done: drop its references (tail first) and free its private blocks."""
        refs, evictable = self._refs, self._evictable
        for block in reversed(held):
            count = refs[block] - 1
            refs[block] = count
            if count == 0:
                evictable[block] = None
        if num_private > self._private:
            raise ValueError(f"releasing {num_private} private blocks of {self._private}")
        self._private -= num_private

    # ---- eviction --------------------------------------------------------------------------

    def _make_room(self, num_blocks: int) -> None:
        shortfall = num_blocks - self.num_free
        if shortfall <= 0:
            return
        refs, evictable = self._refs, self._evictable
        removed: list[BlockHash] = []
        for _ in range(shortfall):
            block, _ = evictable.popitem(last=False)
            del refs[block]
            removed.append(block)
        self._changes.append(CacheChange(EventKind.REMOVED, Tier.GPU, tuple(removed)))
        if self.cpu is not None:
            chain = self._chain
            self._write_cpu(self.cpu, [chain.pop(block) for block in removed])

    def _write_cpu(self, cpu: CpuTier, refs: Sequence[BlockRef]) -> int:
        """Offer ``refs`` to the CPU tier and record what changed there; how many it took."""
        added, dropped = cpu.write(refs)
        if added:
            self._changes.append(CacheChange(EventKind.STORED, Tier.CPU, tuple(added)))
        if dropped:
            self._changes.append(CacheChange(EventKind.REMOVED, Tier.CPU, tuple(dropped)))
        return len(added)
