"""The engine-tier block cache: exact eviction orders and events (the eviction spec)."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash, CacheEvent, EventKind, ReplicaId, Tier
from prefixmesh.replica.sim_model.prefix_cache import (
    CacheChange,
    PrefixCache,
    PrefixMatch,
    SharedTier,
    to_events,
)


def h(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


def run_request(cache: PrefixCache, blocks: list[BlockHash], extra_private: int = 0) -> None:
    """Allocate, compute and store ``blocks``, then release them (a request's whole life)."""
    assert cache.acquire(blocks, 0, len(blocks) + extra_private)
    stored = cache.store(blocks)
    cache.release(stored, len(blocks) + extra_private - len(stored))


def test_release_puts_the_tail_of_a_prompt_first() -> None:
    cache = PrefixCache(8)
    run_request(cache, h(1, 2, 3))
    assert cache.eviction_order() == h(3, 2, 1)
    assert (cache.num_cached, cache.num_private, cache.num_free) == (3, 0, 5)
    assert cache.take_changes() == [CacheChange(EventKind.STORED, Tier.GPU, (1, 2, 3))]
    assert cache.take_changes() == []


def test_lru_across_requests_and_a_hit_moves_blocks_back() -> None:
    cache = PrefixCache(8)
    run_request(cache, h(1, 2))
    run_request(cache, h(5, 6))
    assert cache.eviction_order() == h(2, 1, 6, 5)
    assert cache.match(h(1, 2, 9), 3) == PrefixMatch(2)
    assert cache.acquire(h(1), 1, 0)  # pins block 1: no longer evictable
    assert cache.eviction_order() == h(2, 6, 5)
    cache.release(h(1), 0)
    assert cache.eviction_order() == h(2, 6, 5, 1)


def test_allocation_evicts_from_the_front_and_reports_removals() -> None:
    cache = PrefixCache(4)
    run_request(cache, h(1, 2))
    run_request(cache, h(5, 6))
    cache.take_changes()
    assert cache.acquire(h(9), 0, 3)
    assert cache.eviction_order() == h(5)
    assert cache.take_changes() == [CacheChange(EventKind.REMOVED, Tier.GPU, (2, 1, 6))]
    assert (cache.num_cached, cache.num_private, cache.num_free) == (1, 3, 0)


def test_acquire_that_does_not_fit_changes_nothing() -> None:
    cache = PrefixCache(4)
    run_request(cache, h(1, 2))
    cache.take_changes()
    assert cache.acquire(h(1, 2), 2, 2)  # pins both, fills the rest
    assert not cache.acquire(h(7), 0, 1)
    assert cache.take_changes() == []
    assert (cache.num_cached, cache.num_private, cache.num_evictable) == (2, 2, 0)


def test_pinned_hits_do_not_count_as_room() -> None:
    cache = PrefixCache(4)
    run_request(cache, h(1, 2, 3))  # 3 evictable, 1 free
    assert not cache.acquire(h(1, 2, 3), 3, 2)  # pinning all three leaves 1 block for 2
    assert cache.acquire(h(1, 2, 3), 2, 2)  # pins 1 and 2, evicts 3
    assert cache.take_changes()[-1] == CacheChange(EventKind.REMOVED, Tier.GPU, (3,))


def test_a_block_stored_twice_stays_private_to_the_second_request() -> None:
    cache = PrefixCache(8)
    assert cache.acquire([], 0, 2)
    assert cache.acquire([], 0, 2)
    assert cache.store(h(1, 2)) == h(1, 2)
    assert cache.store(h(1, 2)) == []  # another request cached them first
    assert (cache.num_cached, cache.num_private) == (2, 2)
    cache.release(h(1, 2), 0)
    cache.release([], 2)
    assert (cache.num_cached, cache.num_private, cache.num_free) == (2, 0, 6)


def test_store_checks_its_reservation() -> None:
    cache = PrefixCache(8)
    assert cache.acquire([], 0, 1)
    with pytest.raises(ValueError):
        cache.store(h(1, 2))
    with pytest.raises(ValueError):
        cache.store(h(3, 3))


def test_cpu_tier_keeps_evicted_blocks_and_serves_them_back() -> None:
    cache = PrefixCache(3, cpu_blocks=4)
    run_request(cache, h(1, 2))
    cache.take_changes()
    assert cache.acquire([], 0, 3)  # evicts 2 then 1 into the CPU tier
    assert cache.take_changes() == [
        CacheChange(EventKind.REMOVED, Tier.GPU, (2, 1)),
        CacheChange(EventKind.STORED, Tier.CPU, (2, 1)),
    ]
    assert cache.cpu_blocks() == h(2, 1)
    assert cache.holds(BlockHash(1)) is Tier.CPU
    cache.release([], 3)
    assert cache.match(h(1, 2, 3), 3) == PrefixMatch(2, num_cpu_blocks=2)
    assert cache.acquire(h(1, 2), 2, 1)  # both loaded back into engine blocks
    assert cache.take_changes() == [CacheChange(EventKind.STORED, Tier.GPU, (1, 2))]
    assert cache.holds(BlockHash(1)) is Tier.GPU
    assert sorted(cache.cpu_blocks()) == h(1, 2)  # the CPU copies stay


def test_cpu_tier_drops_its_least_recently_used_blocks() -> None:
    cache = PrefixCache(2, cpu_blocks=2)
    run_request(cache, h(1, 2))
    assert cache.acquire([], 0, 2)  # 2, 1 -> CPU
    stored = cache.store(h(5, 6))
    cache.release(stored, 0)
    cache.take_changes()
    assert cache.acquire([], 0, 2)  # 6, 5 -> CPU; 2, 1 drop out of it
    assert cache.take_changes() == [
        CacheChange(EventKind.REMOVED, Tier.GPU, (6, 5)),
        CacheChange(EventKind.STORED, Tier.CPU, (6, 5)),
        CacheChange(EventKind.REMOVED, Tier.CPU, (2, 1)),
    ]
    assert cache.cpu_blocks() == h(6, 5)


def test_a_block_loaded_back_from_the_cpu_tier_outlives_the_untouched_ones() -> None:
    cache = PrefixCache(2, cpu_blocks=2)
    run_request(cache, h(1))
    run_request(cache, h(5))
    assert cache.acquire([], 0, 2)  # 1, then 5 -> CPU
    cache.release([], 2)
    assert cache.acquire(h(1), 1, 0)  # 1 loaded back (and kept running): now the most recent
    run_request(cache, h(7))
    cache.take_changes()
    assert cache.acquire([], 0, 1)  # 7 -> CPU, which is full: 5 leaves, not 1
    assert cache.take_changes() == [
        CacheChange(EventKind.REMOVED, Tier.GPU, (7,)),
        CacheChange(EventKind.STORED, Tier.CPU, (7,)),
        CacheChange(EventKind.REMOVED, Tier.CPU, (5,)),
    ]
    assert sorted(cache.cpu_blocks()) == h(1, 7)


def test_cpu_batch_larger_than_the_tier_reports_only_what_stays() -> None:
    cache = PrefixCache(3, cpu_blocks=1)
    run_request(cache, h(1, 2, 3))
    cache.take_changes()
    assert cache.acquire([], 0, 3)
    assert cache.take_changes() == [
        CacheChange(EventKind.REMOVED, Tier.GPU, (3, 2, 1)),
        CacheChange(EventKind.STORED, Tier.CPU, (1,)),
    ]


def test_changes_become_sequence_numbered_events() -> None:
    changes = [
        CacheChange(EventKind.STORED, Tier.GPU, (1, 2)),
        CacheChange(EventKind.REMOVED, Tier.GPU, (1,)),
    ]
    replica = ReplicaId("r0")
    assert to_events(changes, replica, first_seq=5, epoch=3) == [
        CacheEvent(EventKind.STORED, replica, 5, 3, Tier.GPU, (1, 2)),
        CacheEvent(EventKind.REMOVED, replica, 6, 3, Tier.GPU, (1,)),
    ]


def test_cached_blocks_and_clearing_the_evictable_ones() -> None:
    cache = PrefixCache(capacity_blocks=8)
    a, b = (BlockHash(1), BlockHash(2)), (BlockHash(3),)
    assert cache.acquire(a, 0, 2) and cache.acquire(b, 0, 1)
    cache.store(a)
    cache.store(b)
    cache.release(a, 0)  # a is evictable now, b is still referenced
    cache.take_changes()
    assert sorted(cache.cached_blocks()) == [1, 2, 3]
    assert sorted(cache.clear_evictable()) == [1, 2]
    assert cache.cached_blocks() == [BlockHash(3)]
    [change] = cache.take_changes()
    assert (change.kind, change.tier) == (EventKind.REMOVED, Tier.GPU)
    assert sorted(change.block_hashes) == [1, 2]


def test_the_shared_tier_is_written_once_by_whoever_computes_and_read_by_every_cache() -> None:
    shared = SharedTier(3)
    first, second = PrefixCache(8, shared=shared), PrefixCache(8, shared=shared)
    run_request(first, h(1, 2))
    assert shared.take_changes() == [CacheChange(EventKind.STORED, Tier.DISK, (1, 2))]
    # The other replica never computed them: it finds them in the shared tier, not its own.
    assert second.match(h(1, 2, 3), 3) == PrefixMatch(2, 0, 2)
    assert second.acquire(h(1, 2, 3), 2, 1)
    assert second.take_changes() == [CacheChange(EventKind.STORED, Tier.GPU, (1, 2))]
    assert second.store(h(1, 2, 3)) == h(3)
    assert shared.take_changes() == [CacheChange(EventKind.STORED, Tier.DISK, (3,))]


def test_the_shared_tier_evicts_its_least_recent_block_for_the_cluster() -> None:
    shared = SharedTier(2)
    shared.write(h(1, 2))
    shared.touch(h(1))
    shared.write(h(3))  # 2 is the least recent
    assert 2 not in shared and 1 in shared and 3 in shared
    shared.write(h(4, 5, 6))  # more than fits in one write: the first two never were held
    assert shared.take_changes()[-2:] == [
        CacheChange(EventKind.STORED, Tier.DISK, (5, 6)),
        CacheChange(EventKind.REMOVED, Tier.DISK, (1, 3)),
    ]
    assert len(shared) == 2


def test_promote_reads_the_shared_blocks_of_a_chain_into_the_cpu_tier_up_to_a_gap() -> None:
    shared = SharedTier(8)
    shared.write(h(2, 3, 5))
    cache = PrefixCache(8, cpu_blocks=2, shared=shared)
    run_request(cache, h(1))  # 1 in the engine tier
    cache.take_changes()
    # 1 is held already; 2 and 3 come up; 4 is nowhere, so 5 would be of no use.
    assert cache.promote(h(1, 2, 3, 4, 5), max_blocks=5, limit=8) == 2
    assert cache.holds(BlockHash(2)) is cache.holds(BlockHash(3)) is Tier.CPU
    assert cache.take_changes() == [CacheChange(EventKind.STORED, Tier.CPU, (2, 3))]
    assert cache.match(h(1, 2, 3), 3).num_cpu_blocks == 2
    assert cache.promote(h(1, 2, 3), max_blocks=3, limit=8) == 0  # nothing left to read
    assert cache.promote(h(5), max_blocks=1, limit=0) == 0
    assert PrefixCache(8, shared=shared).promote(h(2), 1, 8) == 0  # no CPU tier: nowhere to go
