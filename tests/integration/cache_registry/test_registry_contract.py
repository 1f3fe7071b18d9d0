"""One contract for every ``CacheRegistry`` backend (run against in-process and real Redis)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher, FingerprintMismatchError
from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixHit,
    PublishResult,
    ReplicaId,
    Tier,
)
from tests.fakes.clock import FakeClock
from tests.integration.cache_registry.conftest import BLOCK, HASHER, RegistryFactory

pytestmark = pytest.mark.redis
DEADLINE_S = 1.0
R1, R2, R3 = ReplicaId("replica-1"), ReplicaId("replica-2"), ReplicaId("replica-3")
KEY = HASHER.hash_tokens(list(range(8 * BLOCK)))  # 8 blocks
H = KEY.block_hashes


class Sequencer:
    """Numbers events per replica the way a replica's publisher does."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch
        self.next_seq: dict[ReplicaId, int] = {}

    def __call__(
        self,
        kind: EventKind,
        replica: ReplicaId,
        blocks: tuple[BlockHash, ...] = (),
        tier: Tier | None = Tier.GPU,
    ) -> CacheEvent:
        seq = self.next_seq.get(replica, 0)
        self.next_seq[replica] = seq + 1
        return CacheEvent(kind, replica, seq, self.epoch, tier, blocks)


def hit(gpu: int = 0, cpu: int = 0, disk: int = 0, speculative: int = 0) -> PrefixHit:
    return PrefixHit(gpu + cpu + disk, (gpu, cpu, disk), speculative)


async def connected(make_registry: RegistryFactory, **kwargs: object):  # type: ignore[no-untyped-def]
    registry = make_registry(**kwargs)
    await registry.connect()
    return registry


# ---- fingerprint ---------------------------------------------------------------------------


async def test_fingerprint_is_recorded_then_enforced(make_registry: RegistryFactory) -> None:
    await connected(make_registry)
    await connected(make_registry)  # same fingerprint: fine
    for other in [
        BlockHasher(BLOCK * 2, "contract-model"),
        BlockHasher(BLOCK, "contract-model", seed=9),
        BlockHasher(BLOCK, "another-model"),
    ]:
        with pytest.raises(FingerprintMismatchError):
            await make_registry(other.fingerprint).connect()


# ---- lookups -------------------------------------------------------------------------------


async def test_lookup_counts_leading_blocks_per_replica(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish(
        [
            ev(EventKind.STORED, R1, H[:8]),
            ev(EventKind.STORED, R2, H[:3]),
            ev(EventKind.STORED, R3, H[1:8]),  # no block 0: no usable prefix
        ]
    )
    hits = await registry.lookup(KEY, [R1, R2, R3], deadline_s=DEADLINE_S)
    assert hits == {R1: hit(gpu=8), R2: hit(gpu=3)}
    assert await registry.lookup(KEY, [R2, R3], deadline_s=DEADLINE_S) == {R2: hit(gpu=3)}
    assert await registry.lookup(KEY, [], deadline_s=DEADLINE_S) == hits  # empty = all
    assert await registry.lookup(KEY.head(0), [R1], deadline_s=DEADLINE_S) == {}


async def test_walk_stops_at_a_gap(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H[:2] + H[3:8])])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(gpu=2)}


async def test_tiers_count_the_fastest_copy(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish(
        [
            ev(EventKind.STORED, R1, H[:2], Tier.GPU),
            ev(EventKind.STORED, R1, H[:5], Tier.CPU),
            ev(EventKind.STORED, R1, H[:7], Tier.DISK),
        ]
    )
    hits = await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S)
    assert hits == {R1: hit(gpu=2, cpu=3, disk=2)}
    assert hits[R1].deepest_tier is Tier.DISK
    await registry.publish([ev(EventKind.REMOVED, R1, H[:2], Tier.GPU)])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(cpu=5, disk=2)}


async def test_removal_cuts_the_chain(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H), ev(EventKind.STORED, R2, H)])
    await registry.publish([ev(EventKind.REMOVED, R1, (H[4],))])
    hits = await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S)
    assert hits == {R1: hit(gpu=4), R2: hit(gpu=8)}


async def test_cleared_one_tier_or_all(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish(
        [
            ev(EventKind.STORED, R1, H, Tier.GPU),
            ev(EventKind.STORED, R1, H[:4], Tier.CPU),
            ev(EventKind.STORED, R2, H),
        ]
    )
    await registry.publish([ev(EventKind.CLEARED, R1, tier=Tier.GPU)])
    assert await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S) == {
        R1: hit(cpu=4),
        R2: hit(gpu=8),
    }
    await registry.publish([ev(EventKind.CLEARED, R1, tier=None)])
    assert await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S) == {R2: hit(gpu=8)}


# ---- sequencing ----------------------------------------------------------------------------


async def test_replays_are_idempotent_and_gaps_are_reported(
    make_registry: RegistryFactory,
) -> None:
    registry = await connected(make_registry)
    first = CacheEvent(EventKind.STORED, R1, seq=0, epoch=1, block_hashes=H[:2])
    assert await registry.publish([first]) == [PublishResult(R1, applied=1)]
    removed = CacheEvent(EventKind.REMOVED, R1, seq=1, epoch=1, block_hashes=H[:1])
    assert await registry.publish([first, removed]) == [PublishResult(R1, 1, duplicates=1)]
    skipped_ahead = CacheEvent(EventKind.STORED, R1, seq=5, epoch=1, block_hashes=H[:3])
    [result] = await registry.publish([skipped_ahead])
    assert result == PublishResult(R1, applied=1, gap=True)
    assert result.needs_resync
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(gpu=3)}


async def test_a_new_epoch_purges_the_old_entries(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    old, new = Sequencer(epoch=10), Sequencer(epoch=11)
    await registry.publish([old(EventKind.STORED, R1, H), old(EventKind.STORED, R2, H)])
    await registry.add_speculative(KEY, R1, ttl_s=60)
    [result] = await registry.publish([new(EventKind.STORED, R1, H[:2])])
    assert result == PublishResult(R1, applied=1, reset=True)
    hits = await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S)
    assert hits == {R1: hit(gpu=2), R2: hit(gpu=8)}
    # A late event of the old incarnation is ignored.
    [late] = await registry.publish([old(EventKind.STORED, R1, H)])
    assert late == PublishResult(R1, applied=0, duplicates=1)


async def test_a_first_event_past_zero_is_a_gap(make_registry: RegistryFactory) -> None:
    """A registry that restarted (or a subscriber that joined late) must ask for a resync."""
    registry = await connected(make_registry)
    event = CacheEvent(EventKind.STORED, R1, seq=42, epoch=3, block_hashes=H[:1])
    assert (await registry.publish([event]))[0].gap


async def test_an_empty_store_is_a_heartbeat_that_reveals_lost_state(
    make_registry: RegistryFactory,
) -> None:
    """An idle replica's publisher sends an empty ``stored`` now and then: it changes nothing,
    but a registry that lost the replica's state (Redis restarted) sees its seq and reports
    a gap, so the replica resyncs without waiting for its next cache change."""
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H[:3])])
    assert await registry.publish([ev(EventKind.STORED, R1)]) == [PublishResult(R1, applied=1)]
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(gpu=3)}
    fresh = await connected(make_registry)  # another registry: the replica's state is unknown
    if await fresh.lookup(KEY, [R1], deadline_s=DEADLINE_S):
        return  # the backend shares state between clients (Redis): nothing was lost
    [result] = await fresh.publish([ev(EventKind.STORED, R1)])
    assert result.gap and result.needs_resync


async def test_concurrent_publishers(make_registry: RegistryFactory) -> None:
    registries = [await connected(make_registry) for _ in range(4)]
    replicas = [ReplicaId(f"replica-{i}") for i in range(8)]
    keys = [HASHER.hash_tokens([i] * (BLOCK * 6)) for i in range(8)]

    async def replica_publishes(i: int) -> None:
        ev = Sequencer()
        registry = registries[i % len(registries)]
        for _round in range(20):  # store everything, then drop the tail, twenty times over
            await registry.publish([ev(EventKind.STORED, replicas[i], keys[i].block_hashes)])
            await registry.publish(
                [ev(EventKind.REMOVED, replicas[i], keys[i].block_hashes[i % 6 :])]
            )

    await asyncio.gather(*(replica_publishes(i) for i in range(8)))
    for i, key in enumerate(keys):
        expected = {replicas[i]: hit(gpu=i % 6)} if i % 6 else {}
        assert await registries[0].lookup(key, replicas, deadline_s=DEADLINE_S) == expected
    assert await registries[1].known_replicas() == set(replicas)


async def test_holders_per_block_are_bounded(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry, max_holders_per_block=3)
    ev = Sequencer()
    replicas = [ReplicaId(f"replica-{i}") for i in range(6)]
    for replica in replicas:
        await registry.publish([ev(EventKind.STORED, replica, H[:2])])
    hits = await registry.lookup(KEY, replicas, deadline_s=DEADLINE_S)
    assert len(hits) == 3
    assert replicas[-1] in hits
    assert all(h == hit(gpu=2) for h in hits.values())


# ---- speculative entries -------------------------------------------------------------------


async def test_speculative_entries_expire(make_registry: RegistryFactory, clock: FakeClock) -> None:
    registry = await connected(make_registry)
    await registry.add_speculative(KEY.head(5), R1, ttl_s=2.0)
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {
        R1: hit(gpu=5, speculative=5)
    }
    clock.advance(2.5)
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}


async def test_speculative_never_shortens_a_confirmed_entry(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H[:3], Tier.CPU)])
    await registry.add_speculative(KEY, R1, ttl_s=1.0)
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {
        R1: hit(gpu=5, cpu=3, speculative=5)
    }
    clock.advance(5)
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(cpu=3)}


async def test_a_confirmed_removal_deletes_speculative_entries(
    make_registry: RegistryFactory,
) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.add_speculative(KEY, R1, ttl_s=60)
    await registry.publish([ev(EventKind.REMOVED, R1, (H[3],))])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {
        R1: hit(gpu=3, speculative=3)
    }
    await registry.publish([ev(EventKind.CLEARED, R1, tier=None)])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}


# ---- in-flight claims ----------------------------------------------------------------------


async def test_claims_are_exclusive_until_released(make_registry: RegistryFactory) -> None:
    router_a, router_b = await connected(make_registry), await connected(make_registry)
    prefix = H[5]
    assert await router_a.claim_inflight(prefix, R1, ttl_s=30) == R1
    assert await router_b.claim_inflight(prefix, R2, ttl_s=30) == R1
    assert await router_b.inflight(prefix) == R1
    assert not await router_b.release_inflight(prefix, R2)  # only the holder releases
    assert await router_a.release_inflight(prefix, R1)
    assert await router_b.inflight(prefix) is None
    assert await router_b.claim_inflight(prefix, R2, ttl_s=30) == R2


async def test_release_wakes_waiters_in_other_clients(make_registry: RegistryFactory) -> None:
    holder, waiter = await connected(make_registry), await connected(make_registry)
    prefix = H[2]
    await holder.claim_inflight(prefix, R1, ttl_s=30)
    started = time.monotonic()
    waiting = asyncio.create_task(waiter.wait_released(prefix, timeout_s=10))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await holder.release_inflight(prefix, R1)
    assert await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - started < 2


async def test_wait_times_out_while_claimed(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    await registry.claim_inflight(H[1], R1, ttl_s=30)
    started = time.monotonic()
    assert not await registry.wait_released(H[1], timeout_s=0.3)
    assert 0.25 <= time.monotonic() - started < 2
    assert await registry.wait_released(H[7], timeout_s=0.3)  # nothing claimed: at once


async def test_an_abandoned_claim_expires(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry, clock=time.monotonic)
    assert await registry.claim_inflight(H[0], R1, ttl_s=0.3) == R1
    assert await registry.wait_released(H[0], timeout_s=5)
    assert await registry.inflight(H[0]) is None


# ---- hotness -------------------------------------------------------------------------------


async def test_hotness_decays_with_its_half_life(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    router_a = await connected(make_registry, hotness_half_life_s=10.0)
    router_b = await connected(make_registry, hotness_half_life_s=10.0)
    group = H[1]
    for _ in range(5):
        await router_a.touch(group)
        await router_b.touch(group, weight=2.0)
    assert await router_a.rate(group) == pytest.approx(15 * math.log(2) / 10)
    clock.advance(10)
    assert await router_b.rate(group) == pytest.approx(7.5 * math.log(2) / 10)
    await router_a.touch(group, weight=2.5)
    clock.advance(10)
    assert await router_a.rate(group) == pytest.approx(5.0 * math.log(2) / 10)
    assert await router_a.rate(H[6]) == 0.0


# ---- membership ----------------------------------------------------------------------------


async def test_drop_replica_removes_every_trace(make_registry: RegistryFactory) -> None:
    registry, waiter = await connected(make_registry), await connected(make_registry)
    ev = Sequencer()
    await registry.publish(
        [
            ev(EventKind.STORED, R1, H, Tier.GPU),
            ev(EventKind.STORED, R1, H, Tier.DISK),
            ev(EventKind.STORED, R2, H[:4]),
        ]
    )
    await registry.add_speculative(KEY, R1, ttl_s=60)
    await registry.claim_inflight(H[7], R1, ttl_s=60)
    waiting = asyncio.create_task(waiter.wait_released(H[7], timeout_s=10))
    await asyncio.sleep(0.1)
    assert await registry.known_replicas() == {R1, R2}

    await registry.drop_replica(R1)

    assert await asyncio.wait_for(waiting, 5)
    assert await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S) == {R2: hit(gpu=4)}
    assert await registry.inflight(H[7]) is None
    assert await registry.known_replicas() == {R2}
    # A replica that comes back under the same id starts clean: seq 0 is not a gap.
    [result] = await registry.publish([CacheEvent(EventKind.STORED, R1, 0, 1, Tier.GPU, H[:1])])
    assert result == PublishResult(R1, applied=1)


async def test_a_late_guess_does_not_bring_a_dropped_replica_back(
    make_registry: RegistryFactory,
) -> None:
    # Regression: a router's speculative write that landed after drop_replica re-registered
    # the dead replica (its index was never freed again).
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H[:2]), ev(EventKind.STORED, R2, H[:4])])
    await registry.drop_replica(R1)
    await registry.add_speculative(KEY, R1, ttl_s=60)  # written before the router knew
    assert await registry.known_replicas() == {R2}
    assert R1 not in await registry.lookup(KEY, [R1, R2], deadline_s=DEADLINE_S)
    # The replica's own event proves it alive: guesses about it count again.
    await registry.publish([CacheEvent(EventKind.STORED, R1, 0, 2, Tier.GPU, H[:1])])
    await registry.add_speculative(KEY, R1, ttl_s=60)
    hits = await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S)
    assert hits == {R1: PrefixHit(8, (8, 0, 0), 7)}  # guesses count as GPU blocks


async def test_a_confirmed_store_replaces_the_guess(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.add_speculative(KEY, R1, ttl_s=60)
    await registry.publish([ev(EventKind.STORED, R1, H[:3])])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {
        R1: hit(gpu=8, speculative=5)
    }
    await registry.publish([ev(EventKind.REMOVED, R1, H[:1])])  # nothing speculative is left
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}


async def test_speculative_entries_rewritten_keep_their_latest_expiry(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    registry = await connected(make_registry)
    await registry.add_speculative(KEY.head(2), R1, ttl_s=1.0)
    clock.advance(0.5)
    await registry.add_speculative(KEY.head(2), R1, ttl_s=1.0)  # written again: lives to 1.5
    clock.advance(0.7)
    await registry.add_speculative(KEY.head(1), R2, ttl_s=1.0)  # expires R1's first write
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {
        R1: hit(gpu=2, speculative=2)
    }
    clock.advance(0.5)
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}


# ---- liveness ------------------------------------------------------------------------------


async def test_heartbeat_matches_the_last_applied_event(make_registry: RegistryFactory) -> None:
    registry = await connected(make_registry)
    ev = Sequencer(epoch=7)
    await registry.publish([ev(EventKind.STORED, R1, H[:1]) for _ in range(3)])  # seq 0..2
    assert await registry.heartbeat(R1, 7, 2) is True
    assert await registry.heartbeat(R1, 7, 1) is False  # behind: something was lost
    assert await registry.heartbeat(R1, 8, 2) is False  # another epoch
    assert await registry.heartbeat(R2, 7, 2) is False  # never heard of: resync


async def test_reap_drops_only_silent_replicas(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    registry, other = await connected(make_registry), await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H), ev(EventKind.STORED, R2, H[:4])])
    await registry.publish([ev(EventKind.STORED, R3, H[:2])])
    assert await registry.heartbeat(R1, 1, 0)
    clock.advance(2.5)
    assert await registry.heartbeat(R2, 1, 0)  # a heartbeat in step keeps R2 alive
    await registry.publish([ev(EventKind.REMOVED, R3, H[1:2])])  # so does an event (R3)
    clock.advance(1.0)

    assert await registry.reap(3.0) == [R1]
    assert await other.reap(3.0) == []  # idempotent: every live replica may reap
    assert await registry.lookup(KEY, [R1, R2, R3], deadline_s=DEADLINE_S) == {
        R2: hit(gpu=4),
        R3: hit(gpu=1),
    }
    assert await registry.known_replicas() == {R2, R3}
    # Reaped like a drop: a late guess does not bring it back, and its heartbeat says resync.
    await registry.add_speculative(KEY, R1, ttl_s=60)
    assert R1 not in await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S)
    assert await registry.heartbeat(R1, 1, 0) is False
    [result] = await registry.publish([CacheEvent(EventKind.STORED, R1, 0, 2, Tier.GPU, H[:3])])
    assert result == PublishResult(R1, applied=1)  # the resync snapshot starts it afresh
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: hit(gpu=3)}


async def test_a_heartbeat_out_of_step_does_not_keep_a_replica_alive(
    make_registry: RegistryFactory, clock: FakeClock
) -> None:
    registry = await connected(make_registry)
    ev = Sequencer()
    await registry.publish([ev(EventKind.STORED, R1, H[:2])])
    clock.advance(2.0)
    assert await registry.heartbeat(R1, 1, 5) is False
    clock.advance(1.5)
    assert await registry.reap(3.0) == [R1]
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
