"""The engine model's CPU tier: a cache policy's evictions and admissions, and what the
waiting requests tell a lookahead."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.config import KVCacheConfig
from prefixmesh.replica.kvcache.policy import (
    BlockRef,
    LFUPolicy,
    Lookahead,
    LRUPolicy,
    ManualClock,
    TierPolicy,
    make_tier_policy,
)
from prefixmesh.replica.kvcache.policy.base import chain_refs
from prefixmesh.replica.sim_model.cpu_tier import CpuTier
from prefixmesh.replica.sim_model.prefix_cache import CacheChange, PrefixCache


def h(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


def refs(*values: int) -> list[BlockRef]:
    """Single-block chains (each its own prompt's first block)."""
    return [BlockRef(BlockHash(v), None, 0) for v in values]


class RefuseOdd(LRUPolicy):
    """LRU that admits only even hashes."""

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return block % 2 == 0


def test_chain_refs_name_each_blocks_parent_and_position() -> None:
    assert chain_refs(h(7, 8, 9), 1) == [
        BlockRef(BlockHash(8), BlockHash(7), 1),
        BlockRef(BlockHash(9), BlockHash(8), 2),
    ]


def test_lru_by_default_and_a_batch_never_displaces_its_own_blocks() -> None:
    tier = CpuTier(3)
    assert tier.write(refs(1, 2, 3)) == (h(1, 2, 3), [])
    tier.touch(refs(1))
    assert tier.write(refs(4, 5)) == (h(4, 5), h(2, 3))  # 1 was used: it stays
    assert sorted(tier.blocks()) == h(1, 4, 5)
    # Larger than the tier: only the last blocks stay, the others are reported as neither.
    assert tier.write(refs(6, 7, 8, 9)) == (h(7, 8, 9), h(1, 4, 5))


def test_a_block_the_policy_does_not_admit_is_dropped_and_counted() -> None:
    tier = CpuTier(2, TierPolicy(RefuseOdd()))
    assert tier.write(refs(1, 2, 3, 4)) == (h(2, 4), [])
    assert tier.rejected == 2 and 3 not in tier


def test_a_block_a_waiting_request_needs_outlives_older_ones() -> None:
    lookahead = Lookahead(LRUPolicy())
    tier = CpuTier(2, TierPolicy(lookahead, lookahead))
    tier.write(refs(1, 2))
    tier.arrived("waiting", h(1))
    assert tier.write(refs(3)) == (h(3), h(2))  # LRU alone would drop 1
    tier.admitted("waiting", refs(1))
    assert tier.write(refs(4)) == (h(4), h(1))  # it ran: 1 is least recent again


def test_the_policy_hears_of_a_use_when_the_request_runs_not_while_it_waits() -> None:
    lfu = LFUPolicy()
    tier = CpuTier(4, TierPolicy(lfu))
    tier.write(refs(1))
    tier.arrived("r", h(1))
    assert lfu.count(BlockHash(1)) == 1  # as inserted
    tier.admitted("r", refs(1))
    assert lfu.count(BlockHash(1)) == 2


def test_the_prefix_cache_tells_its_cpu_tier_which_requests_wait() -> None:
    lookahead = Lookahead(LRUPolicy())
    cache = PrefixCache(2, cpu_blocks=2, cpu_policy=TierPolicy(lookahead, lookahead))
    for block in (1, 5):
        assert cache.acquire(h(block), 0, 1)
        cache.release(cache.store(h(block)), 0)
    assert cache.acquire([], 0, 2)  # 1, then 5 -> CPU
    cache.release([], 2)
    cache.arrived("next", h(1, 2))
    assert lookahead.needed(BlockHash(1)) and lookahead.queued_requests == 1
    for block in (7, 8):
        assert cache.acquire(h(block), 0, 1)
        cache.release(cache.store(h(block)), 0)
    cache.take_changes()
    assert cache.acquire([], 0, 2)  # 7, 8 -> CPU: 5 leaves, then 7 (1 is needed)
    changes = cache.take_changes()
    assert CacheChange(EventKind.REMOVED, Tier.CPU, (5,)) in changes
    assert BlockHash(1) in cache.cpu_blocks()
    cache.left("next")
    assert lookahead.queued_requests == 0


@pytest.mark.parametrize("name", ["lru", "lfu", "hotprefix", "workload", "nextuse", "adaptive"])
def test_every_connector_policy_can_manage_the_cpu_tier(name: str) -> None:
    clock = ManualClock()
    config = KVCacheConfig(policy=name, lookahead_requests=8)
    managed = make_tier_policy(config, clock=clock, block_tokens=16, capacities=(4,))
    assert isinstance(managed.policy, Lookahead) and managed.queue is managed.policy
    cache = PrefixCache(2, cpu_blocks=4, cpu_policy=managed)
    for request in range(12):
        clock.set(float(request))
        chain = h(request % 3 * 10 + 1, request % 3 * 10 + 2)
        cache.arrived(str(request), chain)
        match = cache.match(chain, 2)
        assert cache.acquire(chain, match.num_blocks, 2 - match.num_blocks)
        cache.admitted(str(request), chain)
        stored = cache.store(chain, match.num_blocks)
        cache.release(list(chain[: match.num_blocks]) + stored, 2 - match.num_blocks - len(stored))
        assert len(cache.cpu_blocks()) <= 4
    alone = make_tier_policy(config, clock=clock, block_tokens=16, lookahead_requests=0)
    assert alone.queue is None and alone.policy.name == name
