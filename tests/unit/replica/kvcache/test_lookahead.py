"""Lookahead (issue 18): the queued requests' blocks are kept, the one needed furthest ahead
goes first when all are needed, needed blocks go down a tier, and nothing is pinned."""

from __future__ import annotations

import random
from collections.abc import Container

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import HotPrefixConfig, KVCacheConfig
from prefixmesh.loadtest.cache_sim_cli import to_cache_requests
from prefixmesh.loadtest.workloads import make_workload
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim
from prefixmesh.replica.kvcache.policy import (
    BlockRef,
    HotPrefixPolicy,
    Lookahead,
    LRUPolicy,
    ManualClock,
    make_tier_policy,
)
from prefixmesh.replica.kvcache.policy.lookahead import SCAN_LIMIT


def blocks(*ids: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(i) for i in ids)


def req(*ids: int) -> CacheRequest:
    return CacheRequest(blocks(*ids))


def chain(*ids: int) -> list[BlockRef]:
    hashes = blocks(*ids)
    return [BlockRef(b, hashes[i - 1] if i else None, i) for i, b in enumerate(hashes)]


def test_an_unneeded_block_goes_before_a_needed_one_whatever_lru_says() -> None:
    policy = Lookahead(LRUPolicy())
    for ref in chain(1, 2):
        policy.on_insert(0, ref)
    policy.on_insert(0, BlockRef(BlockHash(7), None, 0))
    assert LRUPolicy().name == "lru" and policy.name == "lru+lookahead"
    assert policy.victim(0, set()) == BlockHash(1)  # plain LRU: the oldest chain's head
    policy.queued("r1", blocks(1))
    assert policy.needed(BlockHash(1)) and policy.queued_requests == 1
    assert policy.victim(0, set()) == BlockHash(2)  # 1 is needed; 2 is LRU among the rest
    assert policy.victim(0, {BlockHash(2), BlockHash(7)}) == BlockHash(1)  # nothing else left
    policy.started("r1")
    assert not policy.needed(BlockHash(1)) and policy.queued_requests == 0


class CountingLRU(LRUPolicy):
    """LRU that counts the blocks its victim scan asks about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        outer = self

        class Counting:
            def __contains__(self, block: object) -> bool:
                outer.asked += 1
                return block in pinned

        return super().victim(tier, Counting())


def test_the_scan_meets_an_aged_needed_block_once_not_at_every_eviction() -> None:
    lru = CountingLRU()
    policy = Lookahead(lru)
    singles = [BlockRef(BlockHash(i), None, 0) for i in range(1, 11)]
    for ref in singles:
        policy.on_insert(0, ref)
    policy.queued("waiting", blocks(1, 2, 3))
    policy.touch(0, singles[3:])  # the others run while it waits: 1, 2, 3 age to the front
    assert policy.victim(0, set()) == BlockHash(4)
    assert lru.asked == 4  # passed over 1, 2 and 3
    policy.on_remove(0, BlockHash(4), dropped=True)
    lru.asked = 0
    assert policy.victim(0, set()) == BlockHash(5)
    assert lru.asked == 1  # they were moved behind the rest
    assert policy.needed(BlockHash(1)) and policy.first_use(BlockHash(1)) == 0


def test_a_long_scan_is_cut_short_for_the_oldest_unneeded_block() -> None:
    lru = CountingLRU()
    policy = Lookahead(lru)
    needed, unneeded = range(1, SCAN_LIMIT + 7), range(1000, 1030)
    for i in [*needed, *unneeded]:
        policy.on_insert(0, BlockRef(BlockHash(i), None, 0))
    policy.queued("backlog", blocks(*needed))
    policy.touch(0, [BlockRef(BlockHash(1000), None, 0)])  # 1001 is now the oldest unneeded
    assert policy.victim(0, set()) == BlockHash(1001)
    assert lru.asked == SCAN_LIMIT + 1  # cut at the first block past the limit
    lru.asked = 0
    # The needed blocks it passed over went behind the rest: the next scan is short.
    assert policy.victim(0, {BlockHash(1001)}) == BlockHash(1002)
    assert lru.asked == 7  # 5 needed, 1001 pinned, then 1002
    policy.started("backlog")  # plain LRU again (nothing was removed: 1001 is the oldest)
    assert policy.victim(0, set()) == BlockHash(1001)


def test_when_almost_every_block_is_needed_the_wrapped_policy_is_not_asked() -> None:
    lru = CountingLRU()
    policy = Lookahead(lru)
    for i in [*range(1, 31), 1000, 1001]:
        policy.on_insert(0, BlockRef(BlockHash(i), None, 0))
    policy.queued("backlog", blocks(*range(1, 31)))
    assert policy.victim(0, {BlockHash(1000)}) == BlockHash(1001)
    assert lru.asked == 0


def test_all_needed_the_first_use_furthest_ahead_goes_deepest_first() -> None:
    policy = Lookahead(LRUPolicy())
    for ref in chain(1, 2, 3):
        policy.on_insert(0, ref)
    policy.on_insert(0, BlockRef(BlockHash(9), None, 0))
    policy.queued("a", blocks(9))
    policy.queued("b", blocks(1, 2, 3))
    assert policy.first_use(BlockHash(9)) == 0 and policy.first_use(BlockHash(3)) == 1
    assert policy.victim(0, set()) == BlockHash(3)  # b's tail: furthest ahead, deepest
    policy.on_remove(0, BlockHash(3), dropped=True)
    assert policy.victim(0, set()) == BlockHash(2)
    assert policy.victim(0, {BlockHash(2)}) == BlockHash(1)
    policy.queued("c", blocks(9))  # 9's first use stays a's
    policy.started("a")  # now c's, after b's: 9 goes first
    assert policy.first_use(BlockHash(9)) == 2
    assert policy.victim(0, set()) == BlockHash(9)


def test_a_needed_block_goes_down_a_tier_even_when_the_policy_admits_nothing() -> None:
    hot = HotPrefixPolicy(HotPrefixConfig(), block_tokens=16)
    policy = Lookahead(hot)
    policy.on_insert(0, BlockRef(BlockHash(5), None, 0))
    policy.on_insert(1, BlockRef(BlockHash(6), None, 0))
    assert not hot.admit(1, BlockHash(5), BlockHash(6))  # cold: HotPrefix keeps it out
    policy.queued("r", blocks(5))
    assert policy.admit(1, BlockHash(5), BlockHash(6))
    policy.queued("s", blocks(6))  # the block it would displace is needed sooner? no: later
    assert policy.admit(1, BlockHash(5), BlockHash(6))
    policy.started("r")
    policy.queued("t", blocks(5))  # now 6 (s) is needed before 5 (t)
    assert not policy.admit(1, BlockHash(5), BlockHash(6))


def test_the_queue_is_bounded_and_repeated_or_unknown_ids_change_nothing() -> None:
    policy = Lookahead(LRUPolicy(), max_queued=2)
    policy.queued("a", blocks(1))
    policy.queued("a", blocks(2))
    policy.queued("b", blocks(3))
    policy.queued("c", blocks(4))  # over the bound: not tracked
    assert policy.queued_requests == 2
    assert [policy.needed(BlockHash(i)) for i in (1, 2, 3, 4)] == [True, False, True, False]
    policy.started("zzz")
    policy.started("a")
    policy.started("a")
    assert policy.queued_requests == 1 and not policy.needed(BlockHash(1))


TEXTBOOK = [req(1), req(2), req(3), req(1), req(2), req(1)]


def test_in_the_simulator_a_queue_of_one_reaches_belady_on_the_textbook_trace() -> None:
    lru = TieredCacheSim((2,), LRUPolicy()).run(TEXTBOOK)
    looking = Lookahead(LRUPolicy())
    ahead = TieredCacheSim((2,), looking).run(TEXTBOOK, looking, lookahead=1)
    assert (lru.hits, ahead.hits) == (1, 2)  # Belady's 2 of 6 (test_belady.py)
    assert looking.queued_requests == 0  # every queued request started


def test_a_queue_longer_than_the_cache_pins_nothing_and_keeps_the_tiers_whole() -> None:
    rng = random.Random(3)
    requests = []
    for _ in range(300):
        root = rng.randrange(6)
        requests.append(req(*(100 * root + d for d in range(rng.randrange(1, 6)))))
    for capacities in ((4,), (6, 3), (3, 2, 2)):
        looking = Lookahead(LRUPolicy())
        sim = TieredCacheSim(capacities, looking)
        result = sim.run(requests, looking, lookahead=50)
        assert result.requests == 300
        for tier, capacity in enumerate(capacities):
            assert sim.size(tier) <= capacity
        for tier in range(len(capacities)):
            for block in sim.blocks_in(tier):
                depth = int(block) % 100
                if depth:  # its parent is held somewhere: whole chains only
                    assert sim.tier_of(BlockHash(int(block) - 1)) is not None


@pytest.mark.parametrize(
    ("workload", "fraction", "lower_tiers", "window"),
    [
        ("fewshot", 0.05, (), 8),
        ("fewshot", 0.1, (1.0, 2.0), 64),
        ("multiturn", 0.05, (), 64),
        ("multiturn", 0.2, (1.0,), 8),
        ("groups", 0.05, (1.0,), 64),  # 64 waiting requests need more than every tier holds
    ],
)
def test_the_default_policy_with_its_lookahead_never_below_lru(
    workload: str, fraction: float, lower_tiers: tuple[float, ...], window: int
) -> None:
    """Issue 18: the default (``kvcache.policy`` with ``kvcache.lookahead_requests``) keeps at
    least 0.99x LRU's hits over sizes, tier counts and queue lengths."""
    params = {"system_prompt_tokens": 2048} if workload == "groups" else {}
    requests = to_cache_requests(make_workload(workload, params).generate(800, 1.0, 7), 16)
    distinct = len({b for r in requests for b in (*r.blocks, *r.output_blocks)})
    engine = max(1, round(fraction * distinct))
    capacities = (engine, *(round(r * engine) for r in lower_tiers))
    lru = TieredCacheSim(capacities, LRUPolicy()).run(requests)
    clock = ManualClock()
    managed = make_tier_policy(KVCacheConfig(), clock=clock, block_tokens=16, capacities=capacities)
    assert managed.queue is not None  # the default has a lookahead
    looking = TieredCacheSim(capacities, managed.policy, clock).run(requests, managed.queue, window)
    assert looking.hits >= 0.99 * lru.hits, (looking.hits, lru.hits)
