"""The cache-policy seam: what one replica's tiers ask a policy, and the queues policies share.

A policy manages every tier of one cache hierarchy (tier 0 = the engine's own cache, then the
lower tiers: CPU memory, disk). It is pure: no I/O, time only from the injected clock, no
randomness, so a replay gives the same evictions every time. The cache that owns the blocks (the
simulator, the KV connector) tells it what happens and asks it what to do:

- ``on_request(blocks, category)`` when a request arrives, with every full block of its prompt,
  before any block moves (hotness and reuse statistics);
- ``on_insert`` / ``on_remove`` when a block enters or leaves a tier;
- ``touch(tier, blocks)`` with the request's blocks a tier holds after its blocks are placed:
  they become the most recently used, the deepest one first to go (a block is worthless without
  its parent, so a prompt's tail leaves before its head);
- ``victim(tier, pinned)`` for the block to evict next (never one in ``pinned``);
- ``admit(tier, block, displaced)`` whether a block evicted from ``tier - 1`` is written to
  ``tier``, where it would displace ``displaced`` (None when the tier has room);
- ``promotions(pinned)`` lower-tier blocks to move up now, each with the engine-tier blocks to
  drop for it (only HotPrefix plans any).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixmesh.cache_registry.types import BlockHash

Clock = Callable[[], float]
"""Seconds on any fixed origin (a trace's timestamps, a monotonic clock, a logical counter)."""

ENGINE_TIER = 0


class ManualClock:
    """A clock that reads what it was last set to (the simulator advances it per request)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def set(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One full block of a prompt."""

    block: BlockHash
    parent: BlockHash | None
    """The previous block of the chain (None for a prompt's first block)."""
    position: int
    """Index in the prompt (0 = first): the workload-aware policy's offset."""


@dataclass(frozen=True, slots=True)
class Promotion:
    """Move ``block`` from lower tier ``from_tier`` to the engine tier, making room by taking
    ``victims`` (engine-tier blocks, at least as many as it needs) out of it."""

    block: BlockHash
    from_tier: int
    victims: tuple[BlockHash, ...]
    drop_victims: bool = True
    """True: the victims leave every tier; False: they are evicted to the next tier as usual."""


class CachePolicy(Protocol):
    name: str

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None: ...

    def on_insert(self, tier: int, block: BlockRef) -> None: ...

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        """``dropped``: it leaves every tier (False: it is about to enter another one)."""
        ...

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None: ...

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None: ...

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool: ...

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]: ...


class BucketQueues:
    """One tier's blocks in LRU queues, one queue per bucket key (a frequency, a category).

    Within a queue the least recently added or moved block comes first. Policies pick their
    victim among the queues' first unpinned blocks, so a choice costs O(queues), not O(blocks).
    """

    __slots__ = ("_bucket_of", "_queues")

    def __init__(self) -> None:
        self._queues: dict[Hashable, OrderedDict[BlockHash, None]] = {}
        self._bucket_of: dict[BlockHash, Hashable] = {}

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, block: object) -> bool:
        return block in self._bucket_of

    def bucket_of(self, block: BlockHash) -> Hashable:
        return self._bucket_of[block]

    def put(self, block: BlockHash, bucket: Hashable) -> None:
        """Add ``block`` (or move it) to the most recent end of ``bucket``'s queue."""
        old = self._bucket_of.get(block)
        if old is not None and old != bucket:
            self._discard_from(old, block)
        queue = self._queues.get(bucket)
        if queue is None:
            queue = self._queues[bucket] = OrderedDict()
        queue[block] = None
        queue.move_to_end(block)
        self._bucket_of[block] = bucket

    def remove(self, block: BlockHash) -> None:
        bucket = self._bucket_of.pop(block)
        self._discard_from(bucket, block)

    def _discard_from(self, bucket: Hashable, block: BlockHash) -> None:
        queue = self._queues[bucket]
        del queue[block]
        if not queue:
            del self._queues[bucket]

    def heads(self, pinned: Container[BlockHash]) -> Iterator[tuple[Hashable, BlockHash]]:
        """Each non-empty queue's least recent unpinned block, with its bucket key."""
        for bucket, queue in self._queues.items():
            for block in queue:
                if block not in pinned:
                    yield bucket, block
                    break

    def queues(self) -> Iterator[tuple[Hashable, OrderedDict[BlockHash, None]]]:
        """Each non-empty bucket with its queue, least recent first (read only)."""
        return iter(self._queues.items())

    def order(self, bucket: Hashable) -> list[BlockHash]:
        """``bucket``'s blocks, least recent first (tests, reports)."""
        return list(self._queues.get(bucket, ()))

    def blocks(self) -> Iterator[BlockHash]:
        return iter(self._bucket_of)


class TieredQueues:
    """``BucketQueues`` per tier, created on first use."""

    __slots__ = ("_tiers",)

    def __init__(self) -> None:
        self._tiers: dict[int, BucketQueues] = {}

    def __getitem__(self, tier: int) -> BucketQueues:
        queues = self._tiers.get(tier)
        if queues is None:
            queues = self._tiers[tier] = BucketQueues()
        return queues

    def tier_of(self, block: BlockHash) -> int | None:
        for tier, queues in self._tiers.items():
            if block in queues:
                return tier
        return None


def chain_refs(hashes: Sequence[BlockHash], start: int = 0) -> list[BlockRef]:
    """``hashes[start:]`` (one prompt's chained block hashes) as block references: each
    block's parent is the one before it, its position its index."""
    return [BlockRef(hashes[i], hashes[i - 1] if i else None, i) for i in range(start, len(hashes))]


def oldest_idle(
    latest: Mapping[BlockHash, tuple[Any, ...]], resident: Container[BlockHash], keep: int
) -> list[BlockHash]:
    """The blocks to forget so that ``latest`` (block -> its latest use, time first) keeps
    ``keep`` records: the least recently used of those no tier holds (``resident``)."""
    idle = sorted((record[0], block) for block, record in latest.items() if block not in resident)
    return [block for _, block in idle[: max(0, len(latest) - keep)]]


def deepest_first(blocks: Sequence[BlockRef]) -> list[BlockRef]:
    """``blocks`` in the order to mark them used: the deepest first, so it ends up least recent."""
    return sorted(blocks, key=lambda ref: -ref.position)
