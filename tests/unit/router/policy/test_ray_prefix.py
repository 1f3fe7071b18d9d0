from __future__ import annotations

from prefixmesh.router.policy.base import RouteRequest
from prefixmesh.router.policy.ray_prefix import RayPrefixPolicy
from tests.unit.router.policy.builders import (
    chosen_ids,
    fleet,
    hit,
    policy,
    request,
    rid,
    snap,
    view,
)


def ray_prefix(seed: int = 0) -> RayPrefixPolicy:
    built = policy("ray_prefix", seed)
    assert isinstance(built, RayPrefixPolicy)
    return built


def routed(rp: RayPrefixPolicy, replica: str, req: RouteRequest) -> None:
    rp.on_routed(req, rid(replica), 0.0)


def test_falls_back_to_pow2_exactly_when_the_spread_exceeds_10() -> None:
    imbalanced = [snap("a"), snap("b", queued=5, running=6), snap("c", running=5)]
    for seed in range(5):
        decision = ray_prefix(seed).route(request(1, 2), imbalanced, view(), 0.0)
        pow2 = policy("pow2", seed).route(request(1, 2), imbalanced, view(), 0.0)
        assert decision.reason == "imbalanced"
        assert decision.ranked == pow2.ranked
    balanced = [snap("a"), snap("b", queued=5, running=5), snap("c", running=5)]
    assert ray_prefix().route(request(1, 2), balanced, view(), 0.0).reason != "imbalanced"


def test_routes_to_the_longest_match_of_its_own_history_then_the_shortest_queue() -> None:
    rp = ray_prefix()
    routed(rp, "b", request(1, 2, 3, 4))
    routed(rp, "c", request(1, 2, 3, 5))
    routed(rp, "a", request(1, 9))
    replicas = [snap("a"), snap("b", running=2), snap("c", running=1)]
    decision = rp.route(request(1, 2, 3, 7), replicas, view(), 0.0)
    assert decision.reason == "prefix_match"
    assert chosen_ids(decision.ranked) == ["c", "b"]  # both match 3 blocks; c has less queued


def test_below_the_match_rate_threshold_it_picks_the_smallest_tenants() -> None:
    rp = ray_prefix()
    routed(rp, "a", request(1, 2))
    routed(rp, "b", request(1, *range(20, 30)))
    replicas = [snap("a"), snap("b"), snap("c", running=2), snap("d", running=1)]
    # One matched block of 10 blocks + 3 tokens: 1 / 10.75 < 0.1 -> smallest tenants (c, d).
    decision = rp.route(request(1, *range(40, 49), extra_tokens=3), replicas, view(), 0.0)
    assert decision.reason == "smallest_tenant"
    assert chosen_ids(decision.ranked) == ["d", "c"]
    # One of exactly 10 blocks: 0.1 is not below the threshold -> longest match (a and b).
    decision = rp.route(request(1, *range(40, 49)), replicas, view(), 0.0)
    assert decision.reason == "prefix_match"
    assert sorted(chosen_ids(decision.ranked)) == ["a", "b"]


def test_ignores_the_registry_and_forgets_removed_replicas() -> None:
    rp = ray_prefix()
    routed(rp, "b", request(1, 2, 3))
    everything_on_a = view(a=hit(gpu=3))
    assert str(rp.route(request(1, 2, 3), fleet("a", "b"), everything_on_a, 0.0).chosen) == "b"
    rp.on_replica_removed(rid("b"))
    assert rp.tree.size(rid("b")) == 0
    decision = rp.route(request(1, 2, 3), fleet("a", "b", "c"), view(), 0.0)
    assert decision.reason == "smallest_tenant"
