from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.router.policy.affinity import AffinityGroups

G = BlockHash(42)


def groups(**overrides: float) -> AffinityGroups:
    settings = {"target_utilization": 0.5, "hysteresis": 0.25, "max_groups": 3} | overrides
    return AffinityGroups(**settings)  # type: ignore[arg-type]


def test_k_grows_at_once_and_shrinks_only_with_headroom() -> None:
    g = groups()
    assert g.size(G, 0.4) == 1  # needs 0.8 of a replica
    assert g.size(G, 0.6) == 2  # 1.2
    assert g.size(G, 1.2) == 3  # 2.4
    assert g.size(G, 0.9) == 3  # 1.8: 2 replicas would run at 0.9 / 2 = 0.45 > 0.5 / 1.25
    assert g.size(G, 0.75) == 2  # 1.5 x 1.25 = 1.875 fits in 2
    assert g.size(G, 0.6) == 2  # back at 1.2: no flapping up
    assert g.size(G, 0.3) == 1  # cooled
    assert g.known() == {}


def test_only_hot_groups_are_remembered_least_recent_forgotten_first() -> None:
    g = groups(max_groups=2)
    for group in (1, 2, 3):
        g.size(BlockHash(group), 5.0)
    assert set(g.known()) == {2, 3}
    assert g.size(BlockHash(1), 0.9) == 2  # forgotten: restarts from its rate
    assert g.size(BlockHash(7), 0.0) == 1 and g.size(BlockHash(8), float("nan")) == 1


def test_exact_multiples_do_not_round_up() -> None:
    assert groups(target_utilization=0.7).size(G, 1.4) == 2
    with pytest.raises(ValueError, match="target_utilization"):
        groups(target_utilization=0.0)


def test_a_young_group_s_rate_is_corrected_for_the_counter_s_warm_up() -> None:
    g = groups(rate_half_life_s=30.0, max_warmup_boost=4.0)
    assert g.observed(G, 0.0, 100.0) == 0.0  # first seen at 100 s
    # 30 s later the decayed counter reads half of a steady rate: the correction doubles it.
    assert g.observed(G, 0.5, 130.0) == pytest.approx(1.0)
    assert g.observed(G, 0.99, 400.0) == pytest.approx(0.99, rel=1e-3)  # long since warm
    # Right after the first sighting the boost is capped.
    assert g.observed(BlockHash(9), 0.1, 130.0) == pytest.approx(0.4)
    # No correction asked for: the rate as reported.
    assert groups().observed(G, 0.5, 5.0) == 0.5


def test_a_group_is_not_sized_before_this_router_saw_enough_of_its_requests() -> None:
    g = groups(min_requests=3)
    assert [g.observed(G, 2.0, t) for t in (0.0, 0.1)] == [0.0, 0.0]  # k stays 1 meanwhile
    assert g.observed(G, 2.0, 0.2) == 2.0  # the third request: its rate counts
    assert g.size(G, g.observed(G, 2.0, 0.3)) == 4
    assert groups().observed(BlockHash(5), 2.0, 0.0) == 2.0  # default: from the first one
