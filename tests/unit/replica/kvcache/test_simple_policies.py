"""LRU and LFU over the tiers: exact eviction orders."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy import LFUPolicy, LRUPolicy

from .chains import chain, eviction_order, use


def test_lru_evicts_the_least_recent_request_deepest_block_first() -> None:
    policy = LRUPolicy()
    held: set[int] = set()
    use(policy, [1, 2, 3], resident=held)
    use(policy, [4, 5], resident=held)
    assert eviction_order(policy) == [3, 2, 1, 5, 4]
    use(policy, [1, 2], resident=held)  # a request that hits the head of the first prompt
    assert eviction_order(policy) == [3, 5, 4, 2, 1]


def test_lru_skips_pinned_blocks_and_keeps_tiers_apart() -> None:
    policy = LRUPolicy()
    use(policy, [1, 2, 3])
    assert policy.victim(0, {BlockHash(3), BlockHash(2)}) == 1
    assert policy.victim(0, {BlockHash(1), BlockHash(2), BlockHash(3)}) is None
    policy.on_remove(0, BlockHash(3), dropped=False)
    policy.on_insert(1, chain(1, 2, 3)[2])
    assert eviction_order(policy, 1) == [3]
    assert eviction_order(policy, 0) == [2, 1]
    assert policy.admit(1, BlockHash(2), displaced=BlockHash(3))
    assert policy.promotions(set()) == ()


def test_lfu_evicts_the_least_used_then_the_least_recent() -> None:
    policy = LFUPolicy()
    held: set[int] = set()
    use(policy, [1, 2], resident=held)
    use(policy, [3], resident=held)
    use(policy, [1], resident=held)  # 1 counts 2
    use(policy, [3], resident=held)  # 3 counts 2
    assert [policy.count(BlockHash(b)) for b in (1, 2, 3)] == [2, 1, 2]
    assert eviction_order(policy) == [2, 1, 3]


def test_lfu_counts_follow_a_block_between_tiers_and_restart_when_it_leaves() -> None:
    policy = LFUPolicy()
    use(policy, [7])
    use(policy, [7])
    policy.on_remove(0, BlockHash(7), dropped=False)
    policy.on_insert(1, chain(7)[0])
    assert policy.count(BlockHash(7)) == 2
    policy.on_remove(1, BlockHash(7), dropped=True)
    assert policy.count(BlockHash(7)) == 0
    use(policy, [7])
    assert policy.count(BlockHash(7)) == 1
