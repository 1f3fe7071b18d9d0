"""The shared tier in the registry: one replica at a time publishes the shared folder's listing
as ``SHARED_TIER`` (disk tier), its changes as they come, and when that replica stops another
takes over with the whole listing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.cache_registry.types import (
    SHARED_TIER,
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixKey,
    PublishResult,
    Tier,
)
from prefixmesh.replica.engines.base import BlockChange
from prefixmesh.replica.events.publisher import EventPublisher
from prefixmesh.replica.events.shared_tier import SharedTierPublisher, listing_changes
from prefixmesh.replica.kvcache.folders import block_path

B = BlockHash


class _Registry:
    def __init__(self) -> None:
        self.state = RegistryState()

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        return self.state.publish(events)

    def shared(self) -> dict[BlockHash, Tier]:
        """Each block the registry credits to the shared tier, and its tier there."""
        held = {}
        for block in self.state.replica_blocks.get(SHARED_TIER, ()):
            hits = self.state.lookup(PrefixKey((block,), 16), [SHARED_TIER])
            hit = hits[SHARED_TIER]
            held[block] = hit.deepest_tier
        return held


def put(folder: Path, *blocks: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for block in blocks:
        block_path(folder, B(block)).write_bytes(b"a block another replica wrote")


def test_listing_changes_are_stores_and_removals_in_the_disk_tier() -> None:
    assert listing_changes(frozenset({B(1), B(2)}), frozenset({B(2), B(3)})) == [
        BlockChange(EventKind.STORED, Tier.DISK, (B(3),)),
        BlockChange(EventKind.REMOVED, Tier.DISK, (B(1),)),
    ]
    assert listing_changes(frozenset({B(1)}), frozenset({B(1)})) == []


def test_one_replica_publishes_and_another_takes_over_when_it_stops(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    registry = _Registry()

    def make(residency):  # type: ignore[no-untyped-def]
        return EventPublisher(SHARED_TIER, registry, residency, interval_s=0.001)

    async def run() -> None:
        put(folder, 1, 2)
        first = SharedTierPublisher(folder, make, interval_s=60)
        second = SharedTierPublisher(folder, make, interval_s=60)
        await first.step()
        await second.step()
        assert first.publisher is not None and second.publisher is None
        await first.publisher.flush()
        assert registry.shared() == {B(1): Tier.DISK, B(2): Tier.DISK}

        block_path(folder, B(1)).unlink()  # evicted
        put(folder, 3)  # written by some replica
        await first.step()
        await first.publisher.flush()
        assert registry.shared() == {B(2): Tier.DISK, B(3): Tier.DISK}

        await first.stop()  # its process would release the lock by dying, too
        put(folder, 4)
        await second.step()
        assert second.publisher is not None
        await second.publisher.flush()
        assert registry.shared() == {B(2): Tier.DISK, B(3): Tier.DISK, B(4): Tier.DISK}
        await second.stop()

    asyncio.run(run())
