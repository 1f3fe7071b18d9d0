from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    EventKind,
    PublishResult,
    ReplicaId,
    Tier,
)
from prefixmesh.replica.engines.base import BlockChange, Residency
from prefixmesh.replica.events.publisher import EventPublisher

R = ReplicaId("r")
KEY = BlockHasher(2, "m").hash_tokens(list(range(8)))
H = KEY.block_hashes


class FlakyTarget:
    """A registry (the real in-process state) behind a link that can drop batches."""

    def __init__(self) -> None:
        self.state = RegistryState()
        self.drop_next = 0
        self.batches: list[list[CacheEvent]] = []

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        if self.drop_next:
            self.drop_next -= 1
            return [PublishResult(R, 0, failed=True)]
        self.batches.append(list(events))
        return self.state.publish(events)


def engine_tier(blocks: tuple[BlockHash, ...]) -> Residency:
    return Residency(((Tier.GPU, blocks),))


def held(target: FlakyTarget) -> int:
    hit = target.state.lookup(KEY, [R]).get(R)
    return 0 if hit is None else hit.num_blocks


async def test_changes_are_numbered_and_batched() -> None:
    target = FlakyTarget()
    publisher = EventPublisher(R, target, lambda: engine_tier(H), max_batch_events=2)
    publisher.submit(
        [
            BlockChange(EventKind.STORED, Tier.GPU, H[:2]),
            BlockChange(EventKind.STORED, Tier.GPU, H[2:3]),
            BlockChange(EventKind.REMOVED, Tier.GPU, H[2:3]),
        ]
    )
    await publisher.flush()
    assert [[e.seq for e in batch] for batch in target.batches] == [[0, 1], [2]]
    assert {e.epoch for batch in target.batches for e in batch} == {publisher.epoch}
    assert held(target) == 2
    assert publisher.published_events == 3


async def test_a_lost_batch_triggers_a_snapshot_in_a_new_epoch() -> None:
    target = FlakyTarget()
    holding: list[BlockHash] = list(H[:4])
    publisher = EventPublisher(R, target, lambda: engine_tier(tuple(holding)))
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:2])])
    await publisher.flush()
    first_epoch = publisher.epoch
    target.drop_next = 1
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[2:4])])
    await publisher.flush()  # lost: the publisher notices and will resync
    assert held(target) == 2
    await publisher.flush()
    assert publisher.epoch > first_epoch and publisher.resyncs == 1
    snapshot = target.batches[-1][0]
    assert (snapshot.seq, snapshot.kind, snapshot.block_hashes) == (0, EventKind.STORED, H[:4])
    assert held(target) == 4


async def test_resets_are_counted_once_the_registry_acknowledges_them() -> None:
    """A reset's witness for tests: a snapshot after a clear may hold as many blocks as before
    it, so the registry's entry count need not drop; the acknowledged clear is counted."""
    target = FlakyTarget()
    publisher = EventPublisher(R, target, lambda: engine_tier(H[:2]))
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:2])])
    await publisher.flush()
    assert publisher.published_resets == 1  # the epoch's first event purges older epochs
    publisher.submit(
        [BlockChange(EventKind.CLEARED, None), BlockChange(EventKind.STORED, Tier.GPU, H[:2])]
    )
    target.drop_next = 1
    await publisher.flush()  # lost: not acknowledged, not counted
    assert publisher.published_resets == 1
    await publisher.flush()  # the resync's snapshot: a new epoch
    assert (publisher.resyncs, publisher.published_resets) == (1, 2)
    publisher.submit(
        [BlockChange(EventKind.CLEARED, None), BlockChange(EventKind.STORED, Tier.GPU, H[:2])]
    )
    await publisher.flush()
    assert publisher.published_resets == 3 and held(target) == 2


async def test_a_resync_snapshot_names_the_lower_tiers_too() -> None:
    """Regression: the snapshot named only the engine tier, so after any resync the registry
    forgot every block the replica held in its CPU and disk tiers."""
    target = FlakyTarget()
    residency = Residency(((Tier.GPU, H[:1]), (Tier.CPU, H[:3]), (Tier.DISK, H[3:4])))
    publisher = EventPublisher(R, target, lambda: residency)
    publisher._resync_needed = True
    await publisher.flush()
    assert [(e.seq, e.kind, e.tier, e.block_hashes) for e in target.batches[-1]] == [
        (0, EventKind.STORED, Tier.GPU, H[:1]),
        (1, EventKind.STORED, Tier.CPU, H[:3]),
        (2, EventKind.STORED, Tier.DISK, H[3:4]),
    ]
    hit = target.state.lookup(KEY, [R])[R]
    assert (hit.num_blocks, hit.blocks_by_tier) == (4, (1, 2, 1))


async def test_a_gap_reported_by_the_registry_triggers_a_resync() -> None:
    target = FlakyTarget()
    publisher = EventPublisher(R, target, lambda: engine_tier(H[:3]))
    publisher._next_seq = 5  # as if events 0..4 had been lost on the way
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:1])])
    await publisher.flush()
    await publisher.flush()
    assert publisher.resyncs == 1
    assert held(target) == 3


async def test_an_unreachable_registry_is_retried_with_backoff_and_healed_after() -> None:
    # Regression: every 5 ms tick rebuilt the full snapshot and logged a resync while the
    # registry was down, and submitted changes piled up in memory.
    target = FlakyTarget()
    target.drop_next = 10**9  # down
    snapshots = 0

    def residency() -> Residency:
        nonlocal snapshots
        snapshots += 1
        return Residency(((Tier.GPU, H[:3]),))

    publisher = EventPublisher(R, target, residency, interval_s=0.005)
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:1])])
    publisher.start()
    try:
        for _ in range(60):  # 0.6 s down: 120 ticks at the publish interval
            await asyncio.sleep(0.01)
            publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:2])])
        assert snapshots <= 6  # 0.05 + 0.1 + 0.2 + 0.4 s between attempts
        assert len(publisher._pending) <= 1  # the snapshot only
        target.drop_next = 0  # back
        for _ in range(300):
            if held(target) == 3:
                break
            await asyncio.sleep(0.01)
        assert held(target) == 3  # healed within the longest back-off
    finally:
        await publisher.stop()


async def test_an_idle_replica_heals_a_registry_that_lost_its_state() -> None:
    target = FlakyTarget()
    publisher = EventPublisher(
        R, target, lambda: engine_tier(H[:3]), interval_s=0.005, heartbeat_s=0.1
    )
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:3])])
    publisher.start()
    try:
        for _ in range(100):
            if held(target) == 3:
                break
            await asyncio.sleep(0.01)
        target.state = RegistryState()  # the registry restarted empty; the replica stays idle
        for _ in range(100):
            if held(target) == 3:
                break
            await asyncio.sleep(0.01)
        assert held(target) == 3 and publisher.resyncs == 1
    finally:
        await publisher.stop()


class LiveTarget(FlakyTarget):
    """The registry with its liveness calls; ``in_step`` None lets the registry answer."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step: bool | None = None
        self.unreachable = False
        self.heartbeats: list[tuple[int, int]] = []
        self.reaps: list[float] = []

    async def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> bool | None:
        self.heartbeats.append((epoch, seq))
        if self.unreachable:
            return None
        if self.in_step is not None:
            return self.in_step
        return self.state.heartbeat(replica, epoch, seq)

    async def reap(self, dead_after_s: float) -> list[ReplicaId]:
        self.reaps.append(dead_after_s)
        return self.state.reap(dead_after_s)


async def eventually(check, timeout_s: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


async def test_an_idle_replica_heartbeats_its_last_delivered_event() -> None:
    target = LiveTarget()
    publisher = EventPublisher(
        R, target, lambda: engine_tier(H[:2]), heartbeat_s=0.05, liveness=target
    )
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:2])])
    publisher.start()
    try:
        await eventually(lambda: len(target.heartbeats) >= 3)
        assert set(target.heartbeats) == {(publisher.epoch, 0)}
        assert [len(batch) for batch in target.batches] == [1]  # no empty events any more
        assert publisher.resyncs == 0
    finally:
        await publisher.stop()


async def test_a_heartbeat_mismatch_triggers_a_snapshot() -> None:
    target = LiveTarget()
    publisher = EventPublisher(R, target, lambda: engine_tier(H[:3]), liveness=target)
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:3])])
    await publisher.flush()
    first_epoch = publisher.epoch
    target.in_step = False  # the registry restarted, was flushed, or reaped this replica
    publisher._next_heartbeat_at = 0.0  # a heartbeat is due
    await publisher._heartbeat_if_idle()
    await publisher.flush()
    snapshot = target.batches[-1][0]
    assert publisher.epoch > first_epoch and publisher.heartbeat_mismatches == 1
    assert (snapshot.epoch, snapshot.seq, snapshot.block_hashes) == (publisher.epoch, 0, H[:3])


async def test_an_unanswered_heartbeat_is_retried_soon_without_a_resync() -> None:
    target = LiveTarget()
    publisher = EventPublisher(
        R, target, lambda: engine_tier(H[:1]), heartbeat_s=1.0, liveness=target
    )
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, H[:1])])
    await publisher.flush()
    target.unreachable = True
    publisher._next_heartbeat_at = 0.0
    publisher.start()
    try:
        # Asked again after 0.05, 0.1, 0.2 s ... not after a whole heartbeat interval: a
        # registry that comes back without its state is found out quickly.
        await eventually(lambda: len(target.heartbeats) >= 3, timeout_s=0.9)
        assert publisher.resyncs == 0
        target.unreachable, target.state = False, RegistryState()  # back, but empty
        await eventually(lambda: held(target) == 1, timeout_s=2.0)
        assert publisher.resyncs == 1
    finally:
        await publisher.stop()


async def test_reaps_silent_replicas_once_in_contact_for_dead_after_s() -> None:
    target = LiveTarget()
    other = ReplicaId("silent")
    target.state.publish([CacheEvent(EventKind.STORED, other, 0, 1, Tier.GPU, H)])
    target.state.last_seen[other] -= 10.0  # silent for 10 s
    publisher = EventPublisher(
        R,
        target,
        Residency,
        heartbeat_s=0.05,
        liveness=target,
        reap_interval_s=0.05,
        dead_after_s=0.6,
    )
    publisher.start()
    try:
        await asyncio.sleep(0.2)
        assert target.reaps == []  # not before this replica has been in contact for 0.6 s
        await eventually(lambda: publisher.reaped == 1)
        assert target.state.lookup(KEY, [other]) == {}
        assert set(target.state.sequences) == {R}  # registered itself, kept alive
        await asyncio.sleep(0.3)
        assert all(d == 0.6 for d in target.reaps) and len(target.reaps) >= 2
        assert publisher.reaped == 1
    finally:
        await publisher.stop()


async def test_without_a_reap_interval_nothing_is_reaped() -> None:
    target = LiveTarget()
    publisher = EventPublisher(R, target, Residency, heartbeat_s=0.02, liveness=target)
    publisher.start()
    try:
        await eventually(lambda: len(target.heartbeats) >= 3)
        assert target.reaps == []
    finally:
        await publisher.stop()
