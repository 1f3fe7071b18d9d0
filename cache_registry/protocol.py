"""The ``CacheRegistry`` seam between the router, the replicas and the registry backends.

The registry is advisory: it tells the router, approximately, which replica holds which prompt
blocks. No call may raise into a request because the registry is slow, down or wrong; every
backend returns "nothing known" (an empty result, ``None``, ``0.0``) instead and counts it in
``stats``. The one loud failure is ``connect`` finding a different cache fingerprint.

Calls return awaitables: a remote backend's coroutines do their work when awaited; the
in-process backend does it when called and returns a finished future, so a caller that checks
``done()`` first never yields to its loop for it (``router/core/decide.py`` does: one code path for
both, and an in-process decision runs through without interleaving with another).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

from prefixmesh.cache_registry.hashing import CacheFingerprint
from prefixmesh.cache_registry.registry_health import RegistryHealth
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

    @property
    def available(self) -> bool:
        """Whether a call now can get an answer: False while the backend backs off after a
        failure or after a fingerprint mismatch (the in-process registry always can). A lookup
        that finds nothing on an unavailable registry is ``unavailable``, not ``empty``."""
        ...

    @property
    def health(self) -> RegistryHealth:
        """What this client knows of the registry's health from its own calls (healthy, a
        fingerprint mismatch, its latest failure while it lasts)."""
        ...

    async def connect(self) -> None:
        """Check (or record) the fingerprint; raises ``FingerprintMismatchError`` on a mismatch.

        A registry that cannot be reached at connect time checks when it comes back.
        """
        ...

    async def close(self) -> None: ...

    def lookup(
        self, key: PrefixKey, replicas: Collection[ReplicaId], *, deadline_s: float
    ) -> Awaitable[dict[ReplicaId, PrefixHit]]:
        """Leading blocks of ``key`` each replica holds (confirmed or speculative).

        Only replicas in ``replicas`` are considered (all, when empty); replicas holding nothing
        are left out. The walk stops at the first block that no candidate whose chain is still
        unbroken holds. Returns ``{}`` if the answer does not arrive within ``deadline_s``.
        """
        ...

    def publish(self, events: Sequence[CacheEvent]) -> Awaitable[list[PublishResult]]:
        """Apply replicas' cache events in order; one result per replica in the batch."""
        ...

    def add_speculative(self, key: PrefixKey, replica: ReplicaId, ttl_s: float) -> Awaitable[None]:
        """Record at routing time that ``replica`` is about to hold ``key``, for ``ttl_s``.

        Speculative entries live apart from confirmed ones: they never shorten a confirmed
        entry, and a confirmed removal or a replica reset deletes them.
        """
        ...

    def claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float
    ) -> Awaitable[ReplicaId | None]:
        """Claim that ``replica`` is computing ``prefix`` now, unless someone else holds it.

        Returns the holder after the attempt (``replica`` if the claim was taken), or ``None``
        if the registry could not answer.
        """
        ...

    def inflight(self, prefix: BlockHash) -> Awaitable[ReplicaId | None]: ...

    def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> Awaitable[bool]:
        """Release the claim if ``replica`` holds it; wakes every waiter. True if released."""
        ...

    async def wait_released(self, prefix: BlockHash, timeout_s: float) -> bool:
        """Wait until ``prefix`` has no in-flight claim; False if still claimed at the timeout
        (or the registry could not answer)."""
        ...

    def touch(self, group: BlockHash, weight: float = 1.0) -> Awaitable[None]:
        """Add ``weight`` to the decayed traffic counter of a prefix group."""
        ...

    def rate(self, group: BlockHash) -> Awaitable[float]:
        """The decayed traffic of a prefix group, in weight per second."""
        ...

    def drop_replica(self, replica: ReplicaId) -> Awaitable[None]:
        """Remove every trace of a replica: entries, speculative entries, claims, sequence."""
        ...

    def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> Awaitable[bool | None]:
        """A live replica's proof of life, and its check that the registry is still in step.

        True iff the last event applied for ``replica`` is (``epoch``, ``seq``): the replica
        counts as seen now. False if the registry knows another position or none (it restarted,
        was flushed, or reaped the replica): the replica must resync. ``None`` if the registry
        could not answer. Every published event also counts as seen.
        """
        ...

    def reap(self, dead_after_s: float) -> Awaitable[list[ReplicaId]]:
        """Drop (as ``drop_replica``) every replica not seen for more than ``dead_after_s``.

        Atomic and idempotent: any number of processes may reap the same registry. Returns the
        replicas dropped by this call ([] if the registry could not answer).
        """
        ...

    def known_replicas(self) -> Awaitable[set[ReplicaId]]:
        """Replicas that have published events since they were last dropped."""
        ...


async def settled(call: asyncio.Future[Any], timeout_s: float) -> bool:
    """Whether ``call`` is done within ``timeout_s``: at once, without yielding to the loop,
    when it is already (the in-process registry's calls are). A late call runs on (shielded);
    a failed one is done (its ``result()`` raises)."""
    if not call.done():
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(call), max(timeout_s, 0.0))
    return call.done()


def group_by_replica(events: Sequence[CacheEvent]) -> dict[ReplicaId, list[CacheEvent]]:
    """Split a batch per replica, keeping each replica's events in their original order."""
    grouped: dict[ReplicaId, list[CacheEvent]] = {}
    for event in events:
        grouped.setdefault(event.replica_id, []).append(event)
    return grouped
