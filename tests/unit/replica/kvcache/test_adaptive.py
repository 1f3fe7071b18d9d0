"""The adaptive policy (issue 18): the candidate whose shadow cache hit most lately decides;
every candidate keeps the real tiers' bookkeeping, so a switch takes effect at once."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import KVCacheConfig, load_config
from prefixmesh.loadtest.cache_sim_cli import to_cache_requests
from prefixmesh.loadtest.workloads import make_workload
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim
from prefixmesh.replica.kvcache.policy import (
    LFUPolicy,
    LRUPolicy,
    ManualClock,
    make_policy,
)
from prefixmesh.replica.kvcache.policy.adaptive import AdaptivePolicy


def req(*ids: int) -> CacheRequest:
    return CacheRequest(tuple(BlockHash(i) for i in ids))


def test_the_leader_is_the_candidate_whose_shadow_hits_most() -> None:
    # A hot block among one-off ones: LFU keeps it, LRU lets the one-offs push it out.
    policy = AdaptivePolicy([("lru", LRUPolicy), ("lfu", LFUPolicy)], (2,), 50.0)
    sim = TieredCacheSim((2,), policy)
    assert policy.leader == "lru"  # the first candidate leads before any evidence
    hot = 1
    sim.access(req(hot))  # used twice: LFU's count keeps it over blocks used once
    for one_off in range(100, 140, 2):
        sim.access(req(hot))
        sim.access(req(one_off))
        sim.access(req(one_off + 1))
    assert policy.scores["lfu"] > policy.scores["lru"]
    assert (policy.leader, policy.switches) == ("lfu", 1)
    # From now on LFU evicts in the real cache: a block used twice outlives one used once
    # (LRU would evict 7 for 9 and miss it next).
    before = sim.result().hits
    for block in (7, 7, 8, 9, 7):
        sim.access(req(block))
    assert sim.result().hits == before + 2
    assert policy.leader == "lfu"


def test_ties_keep_the_leader_and_without_tiers_to_shadow_the_first_candidate_decides() -> None:
    policy = AdaptivePolicy([("lru", LRUPolicy), ("lfu", LFUPolicy)], (4,), 50.0)
    sim = TieredCacheSim((4,), policy)
    for _ in range(3):
        sim.access(req(1, 2))  # both candidates hit alike
    assert policy.scores["lru"] == policy.scores["lfu"] > 0
    assert (policy.leader, policy.switches) == ("lru", 0)
    blind = AdaptivePolicy([("lfu", LFUPolicy), ("lru", LRUPolicy)], (0, 8), 50.0)
    TieredCacheSim((2,), blind).run([req(1), req(2), req(3)])
    assert (blind.leader, blind.scores) == ("lfu", {"lfu": 0.0, "lru": 0.0})
    with pytest.raises(ValueError):
        AdaptivePolicy([], (4,), 50.0)


def test_make_policy_builds_the_configured_candidates() -> None:
    config = load_config(overrides=["kvcache.adaptive.candidates=[workload,lru]"]).kvcache
    policy = make_policy("adaptive", config, clock=ManualClock(), block_tokens=16, capacities=(8,))
    assert isinstance(policy, AdaptivePolicy)
    assert (policy.names, policy.leader) == (("workload", "lru"), "workload")


@pytest.mark.parametrize(
    ("workload", "fraction", "lower_tiers"),
    [
        ("fewshot", 0.05, ()),
        ("fewshot", 0.1, (1.0, 2.0)),
        ("multiturn", 0.05, ()),
        ("multiturn", 0.2, (1.0,)),
    ],
)
def test_never_below_lru_on_the_synthetic_workloads(
    workload: str, fraction: float, lower_tiers: tuple[float, ...]
) -> None:
    requests = to_cache_requests(make_workload(workload, {}).generate(800, 1.0, 7), 16)
    distinct = len({b for r in requests for b in (*r.blocks, *r.output_blocks)})
    engine = max(1, round(fraction * distinct))
    capacities = (engine, *(round(r * engine) for r in lower_tiers))
    lru = TieredCacheSim(capacities, LRUPolicy()).run(requests)
    clock = ManualClock()
    policy = make_policy(
        "adaptive", KVCacheConfig(), clock=clock, block_tokens=16, capacities=capacities
    )
    adaptive = TieredCacheSim(capacities, policy, clock).run(requests)
    assert adaptive.hits >= 0.99 * lru.hits, (adaptive.hits, lru.hits)
