"""The shared cache vocabulary: block hashes, prefix keys, tiers, cache events and hits.

Router, replicas and registry backends all speak these types; nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

BlockHash = NewType("BlockHash", int)
"""Chained hash of one full block (unsigned 64-bit), identical in every process and machine."""

ReplicaId = NewType("ReplicaId", str)
"""One Ray Serve replica: one engine, one data-parallel rank."""


class Tier(enum.IntEnum):
    """Where a replica holds a block; a larger value is a deeper (slower) tier."""

    GPU = 0
    """The engine's own KV cache (called GPU even when the engine runs on CPU)."""
    CPU = 1
    DISK = 2

    @property
    def bit(self) -> int:
        return 1 << int(self)


ALL_TIERS_MASK = Tier.GPU.bit | Tier.CPU.bit | Tier.DISK.bit

DROPPED_REPLICA_MEMORY_S = 60.0
"""How long a registry remembers that it dropped a replica: a router's speculative write
that lands after the drop (written before it learnt of the death) must not bring the replica
back. The replica's own next event clears the mark (it is alive after all, and resyncs). Far
longer than a speculative TTL or a routing decision."""


def shallowest_tier(mask: int) -> Tier:
    """The fastest tier present in a bitmask of tiers (mask must be non-zero)."""
    for tier in Tier:
        if mask & tier.bit:
            return tier
    raise ValueError(f"empty tier mask {mask}")


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """The chained hashes of a prompt's full blocks; block i's hash covers blocks 0..i."""

    block_hashes: tuple[BlockHash, ...]
    block_size: int

    def __len__(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the full blocks (a partial trailing block is never hashed)."""
        return len(self.block_hashes) * self.block_size

    def head(self, num_blocks: int) -> PrefixKey:
        """The key of the first ``num_blocks`` blocks (a prefix group, an in-flight prefix)."""
        return PrefixKey(self.block_hashes[:num_blocks], self.block_size)

    @property
    def last(self) -> BlockHash | None:
        """The hash that names the whole prefix (the chain makes it unique), or None if empty."""
        return self.block_hashes[-1] if self.block_hashes else None


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    """Every block of the replica in ``tier`` (or in all tiers when tier is None) is gone."""


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One change of what a replica holds, sequence-numbered per replica.

    ``epoch`` names one incarnation of the replica's cache (set at engine start); a new epoch means
    the replica restarted with an empty cache, so the registry must forget its old entries.
    ``seq`` counts events within an epoch from 0 without gaps; a gap means events were lost.
    """

    kind: EventKind
    replica_id: ReplicaId
    seq: int
    epoch: int = 0
    tier: Tier | None = Tier.GPU
    block_hashes: tuple[BlockHash, ...] = ()

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"seq must be >= 0, got {self.seq}")
        if self.kind is not EventKind.CLEARED and self.tier is None:
            raise ValueError(f"{self.kind.value} events need a tier")
        if self.kind is EventKind.CLEARED and self.block_hashes:
            raise ValueError("cleared events carry no block hashes")


SHARED_TIER = ReplicaId("@shared-tier")
"""The cluster's shared tier (a directory every replica loads from) as the registry records it:
once for the whole cluster, as if one holder kept its blocks in the disk tier. No replica has
this id; routers take its hit out of a lookup and credit it to every replica
(``router.policy.base.registry_view``)."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prefix one replica holds.

    ``blocks_by_tier[t]`` counts the leading blocks whose fastest copy on the replica is in tier
    ``t``; a block known only from a speculative (routing-time) entry counts as GPU and also in
    ``num_speculative``.
    """

    num_blocks: int
    blocks_by_tier: tuple[int, int, int] = (0, 0, 0)
    num_speculative: int = 0

    @property
    def deepest_tier(self) -> Tier:
        """The slowest tier needed to serve the hit (GPU when the hit is empty)."""
        for tier in reversed(Tier):
            if self.blocks_by_tier[tier]:
                return tier
        return Tier.GPU


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What a registry made of one replica's part of a ``publish`` call."""

    replica_id: ReplicaId
    applied: int
    """Events applied."""
    duplicates: int = 0
    """Events skipped because their seq was already applied (replays are idempotent)."""
    gap: bool = False
    """A seq was missing before an applied event: the registry may have lost changes."""
    reset: bool = False
    """A new epoch was seen: the replica's previous entries were purged."""
    failed: bool = False
    """The registry could not be reached; nothing was applied."""

    @property
    def needs_resync(self) -> bool:
        return self.gap or self.failed


@dataclass(slots=True)
class RegistryStats:
    """Counters a registry client keeps about its own health (mutable, one per client)."""

    lookups: int = 0
    lookup_failures: int = 0
    """Lookups that returned "nothing known" because the registry was slow, down or disabled."""
    publish_failures: int = 0
    reconnects: int = 0
    other_failures: int = 0
    last_error: str = field(default="")
