"""The ``CacheRegistry`` seam between the router, the replicas and the registry backends.

The registry is advisory: it tells the router, approximately, which replica holds which prompt
blocks. No call may raise into a request because the registry is slow, down or wrong; every
backend returns "nothing known" (an empty result, ``None``, ``0.0``) instead and counts it in
``stats``. The one loud failure is ``connect`` finding a different cache fingerprint.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from prefixmesh.cache_registry.hashing import CacheFingerprint
from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    PrefixHit,
    PrefixKey,
    PublishResult,
    RegistryStats,
    ReplicaId,
)


@runtime_checkable
class CacheRegistry(Protocol):
    fingerprint: CacheFingerprint
    stats: RegistryStats

    async def connect(self) -> None:
        """Check (or record) the fingerprint; raises ``FingerprintMismatchError`` on a mismatch.

        A registry that cannot be reached at connect time checks when it comes back.
        """
        ...

    async def close(self) -> None: ...

    async def lookup(
        self, key: PrefixKey, replicas: Collection[ReplicaId], *, deadline_s: float
    ) -> dict[ReplicaId, PrefixHit]:
        """Leading blocks of ``key`` each replica holds (confirmed or speculative).

        Only replicas in ``replicas`` are considered (all, when empty); replicas holding nothing
        are left out. The walk stops at the first block that no candidate whose chain is still
        unbroken holds. Returns ``{}`` if the answer does not arrive within ``deadline_s``.
        """
        ...

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        """Apply replicas' cache events in order; one result per replica in the batch."""
        ...

    async def add_speculative(self, key: PrefixKey, replica: ReplicaId, ttl_s: float) -> None:
        """Record at routing time that ``replica`` is about to hold ``key``, for ``ttl_s``.

        Speculative entries live apart from confirmed ones: they never shorten a confirmed
        entry, and a confirmed removal or a replica reset deletes them.
        """
        ...

    async def claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float
    ) -> ReplicaId | None:
        """Claim that ``replica`` is computing ``prefix`` now, unless someone else holds it.

        Returns the holder after the attempt (``replica`` if the claim was taken), or ``None``
        if the registry could not answer.
        """
        ...

    async def inflight(self, prefix: BlockHash) -> ReplicaId | None: ...

    async def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> bool:
        """Release the claim if ``replica`` holds it; wakes every waiter. True if released."""
        ...

    async def wait_released(self, prefix: BlockHash, timeout_s: float) -> bool:
        """Wait until ``prefix`` has no in-flight claim; False if still claimed at the timeout
        (or the registry could not answer)."""
        ...

    async def touch(self, group: BlockHash, weight: float = 1.0) -> None:
        """Add ``weight`` to the decayed traffic counter of a prefix group."""
        ...

    async def rate(self, group: BlockHash) -> float:
        """The decayed traffic of a prefix group, in weight per second."""
        ...

    async def drop_replica(self, replica: ReplicaId) -> None:
        """Remove every trace of a replica: entries, speculative entries, claims, sequence."""
        ...

    async def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> bool | None:
        """A live replica's proof of life, and its check that the registry is still in step.

        True iff the last event applied for ``replica`` is (``epoch``, ``seq``): the replica
        counts as seen now. False if the registry knows another position or none (it restarted,
        was flushed, or reaped the replica): the replica must resync. ``None`` if the registry
        could not answer. Every published event also counts as seen.
        """
        ...

    async def reap(self, dead_after_s: float) -> list[ReplicaId]:
        """Drop (as ``drop_replica``) every replica not seen for more than ``dead_after_s``.

        Atomic and idempotent: any number of processes may reap the same registry. Returns the
        replicas dropped by this call ([] if the registry could not answer).
        """
        ...

    async def known_replicas(self) -> set[ReplicaId]:
        """Replicas that have published events since they were last dropped."""
        ...


def group_by_replica(events: Sequence[CacheEvent]) -> dict[ReplicaId, list[CacheEvent]]:
    """Split a batch per replica, keeping each replica's events in their original order."""
    grouped: dict[ReplicaId, list[CacheEvent]] = {}
    for event in events:
        grouped.setdefault(event.replica_id, []).append(event)
    return grouped
