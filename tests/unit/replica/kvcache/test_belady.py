"""Belady's offline reference: next uses computed before the replay, furthest next use evicted
among each tier's leaves, demotion only of blocks the lower tiers would keep; known answers on
hand-made traces, and never behind LRU on seeded random prefix trees."""

from __future__ import annotations

import random

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import KVCacheConfig
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim, future_uses
from prefixmesh.replica.kvcache.policy import (
    NEVER,
    POLICY_NAMES,
    BeladyPolicy,
    FutureUses,
    LRUPolicy,
    ManualClock,
    make_policy,
)

from .chains import chain


def req(*blocks: int, output: tuple[int, ...] = ()) -> CacheRequest:
    return CacheRequest(
        tuple(BlockHash(b) for b in blocks), output_blocks=tuple(BlockHash(b) for b in output)
    )


def belady(capacities: tuple[int, ...], requests: list[CacheRequest]) -> TieredCacheSim:
    return TieredCacheSim(capacities, BeladyPolicy(future_uses(requests), capacities))


def tiers(sim: TieredCacheSim) -> list[list[int]]:
    return [sorted(sim.blocks_in(t)) for t in range(len(sim.capacities))]


def test_future_uses_are_the_next_prompt_that_holds_each_block() -> None:
    requests = [req(1, 2, output=(3,)), req(4), req(1, 2, 3), req(1)]
    future = future_uses(requests)
    assert future.next_use == (
        (2, 2, 2),  # answer block 3 is used by request 2's prompt
        (NEVER,),
        (3, NEVER, NEVER),
        (NEVER,),
    )
    assert len(future) == 4


def test_the_textbook_trace_beats_lru() -> None:
    # a b c a b with room for two: LRU always evicts what comes next; Belady keeps a.
    requests = [req(1), req(2), req(3), req(1), req(2)]
    lru = TieredCacheSim((2,), LRUPolicy()).run(requests)
    sim = belady((2,), requests)
    assert [sim.access(r) for r in requests] == [(0,), (0,), (0,), (1,), (0,)]
    assert (lru.hits, sim.result().hits) == (0, 1)


def test_a_looping_scan_keeps_what_it_can_where_lru_keeps_nothing() -> None:
    # 1..4 cycled through room for 3: LRU misses every time; Belady hits 2 of every 3 after
    # the first pass (the classic bound for a loop one larger than the cache).
    requests = [req(b) for b in [1, 2, 3, 4] * 4]
    assert TieredCacheSim((3,), LRUPolicy()).run(requests).hits == 0
    assert belady((3,), requests).run(requests).hits == 8


def test_a_parent_outlives_its_child_even_when_their_next_uses_tie() -> None:
    # 1 -> 2 -> 3 all come back in request 2: block-level Belady, breaking the tie by hash or
    # age, could evict the head and leave 2 and 3 unusable. Here the tail (3) goes for 4, and
    # request 2 hits 1 and 2.
    requests = [req(1, 2, 3), req(4), req(1, 2, 3)]
    sim = belady((3,), requests)
    assert sim.access(requests[0]) == (0,)
    assert sim.access(requests[1]) == (0,)
    assert tiers(sim) == [[1, 2, 4]]
    assert sim.access(requests[2]) == (2,)
    assert tiers(sim) == [[1, 2, 3]]  # 4 (never used again) made room for 3


def test_only_leaves_are_victims_so_no_child_outlives_its_parent() -> None:
    # A future in which the child 2 is used sooner than its parent 1 (only an unchained trace
    # can say so): block-level Belady would evict 1 first and strand 2 and 3. The leaf rule
    # takes the furthest *leaf*: 3 (used at 5) before 7 (at 3), then 2, and 1 last.
    policy = BeladyPolicy(FutureUses(((NEVER, 1, 5), (3,))), (8,))
    for refs in (chain(1, 2, 3), chain(7)):
        policy.on_request(refs, "")
        for ref in refs:
            policy.on_insert(0, ref)
    order = []
    while (victim := policy.victim(0, set())) is not None:
        order.append(int(victim))
        policy.on_remove(0, victim, dropped=True)
    assert order == [3, 7, 2, 1]


def test_victims_skip_pinned_blocks_and_put_them_back_for_the_next_request() -> None:
    future = FutureUses(((NEVER, NEVER), (NEVER,), (NEVER,)))
    policy = BeladyPolicy(future, (8,))
    refs = chain(1, 2)
    policy.on_request(refs, "")
    for ref in refs:
        policy.on_insert(0, ref)
    pinned = {BlockHash(1), BlockHash(2)}
    assert policy.victim(0, pinned) is None
    assert policy.victim(0, set()) == 2  # another pinned set: the set-aside entries are back
    policy.on_request(chain(7), "")
    assert policy.victim(0, {BlockHash(7)}) == 2
    policy.on_remove(0, BlockHash(2), dropped=True)
    assert policy.victim(0, set()) == 1  # a leaf once its child left
    assert policy.promotions(set()) == ()


def test_a_replay_that_is_not_the_computed_future_is_refused() -> None:
    policy = BeladyPolicy(future_uses([req(1, 2)]), (4,))
    with pytest.raises(ValueError, match="not the one"):
        policy.on_request(chain(1, 2, 3), "")
    policy.on_request(chain(1, 2), "")
    with pytest.raises(ValueError, match="past"):
        policy.on_request(chain(1, 2), "")


def test_lower_tiers_keep_the_soonest_and_skip_blocks_never_used_again() -> None:
    # Engine 1 + CPU 1. 1 (used at 3) and 2 (used at 4) pass through; 9 is never used again.
    requests = [req(1), req(2), req(9), req(1), req(2)]
    sim = belady((1, 1), requests)
    sim.access(requests[0])
    sim.access(requests[1])  # 1 goes down (room)
    assert tiers(sim) == [[2], [1]]
    sim.access(requests[2])  # 2 (used at 4) is later than 1 (used at 3): dropped, 1 kept
    assert tiers(sim) == [[9], [1]]
    assert sim.access(requests[3]) == (0, 1)  # loaded back; 9 is never written down
    result = sim.result()
    assert (result.blocks_written, result.blocks_rejected) == (1, 2)


def test_a_demoted_block_may_pass_a_sooner_victim_down_to_a_roomier_tier() -> None:
    # Engine 1, CPU 1, disk 2: 5 (used at 4) is later than the CPU's 1 (used at 3), but the
    # disk has room, so 5 is written and 1 moves down: nothing is lost.
    requests = [req(1), req(5), req(7), req(1), req(5)]
    sim = belady((1, 1, 2), requests)
    for request in requests[:3]:
        sim.access(request)
    assert tiers(sim) == [[7], [5], [1]]
    assert [sim.access(r) for r in requests[3:]] == [(0, 0, 1), (0, 1, 0)]


def test_a_head_is_admitted_over_its_own_tail_in_the_tier_below() -> None:
    # Engine 2, CPU 1: request 1 evicts the tail 2 (down) then the head 1; 1 and 2 tie on next
    # use, and 1 is the earlier key, so it takes the CPU slot (dropping it would drop 2 too).
    requests = [req(1, 2), req(5, 6), req(1, 2)]
    sim = belady((2, 1), requests)
    sim.access(requests[0])
    sim.access(requests[1])
    assert tiers(sim) == [[5, 6], [1]]
    assert sim.access(requests[2]) == (0, 1)


def _random_trace(rng: random.Random) -> list[CacheRequest]:
    """Prompts that walk a random prefix tree (chained: a node's id fixes its whole path)."""
    nodes: dict[tuple[int, ...], int] = {}
    out = []
    for index in range(rng.randint(5, 50)):
        path: tuple[int, ...] = ()
        blocks = []
        for depth in range(rng.randint(1, 7)):
            path = (*path, rng.randint(0, 2 if depth else 5))
            blocks.append(BlockHash(nodes.setdefault(path, len(nodes) + 1)))
        out.append(CacheRequest(tuple(blocks), time_s=float(index)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_never_behind_an_online_policy_on_random_prefix_trees(seed: int) -> None:
    rng = random.Random(seed)
    requests = _random_trace(rng)
    capacities = tuple(rng.randint(1, 8) for _ in range(rng.choice((1, 2, 3))))
    parent = {b: r.blocks[i - 1] for r in requests for i, b in enumerate(r.blocks) if i}
    sim = belady(capacities, requests)
    for request in requests:
        sim.access(request)
        for block in (b for tier in range(len(capacities)) for b in sim.blocks_in(tier)):
            # Prefix-closed, and no parent in a lower tier than its child.
            up = parent.get(block)
            assert up is None or (sim.tier_of(up) or 0) <= (sim.tier_of(block) or 0)
            assert up is None or sim.tier_of(up) is not None
    best = sim.result().hits
    for name in POLICY_NAMES:
        clock = ManualClock()
        policy = make_policy(name, KVCacheConfig(), clock=clock, block_tokens=16)
        assert TieredCacheSim(capacities, policy, clock).run(requests).hits <= best, name
