from __future__ import annotations

from prefixmesh.router.policy.sglang import SGLangPolicy
from tests.unit.router.policy.builders import fleet, hit, policy, request, rid, snap, view


def sglang(**section: object) -> SGLangPolicy:
    built = policy("sglang", **section)
    assert isinstance(built, SGLangPolicy)
    return built


def test_imbalance_needs_both_the_absolute_and_the_relative_threshold() -> None:
    def route(load_a: int, load_b: int) -> tuple[str, str]:
        sg = sglang(balance_abs_threshold=4, balance_rel_threshold=1.5)
        sg.on_routed(request(1, 2, 3), rid("a"), 0.0)  # a holds the prompt
        decision = sg.route(
            request(1, 2, 3), [snap("a", running=load_a), snap("b", running=load_b)], view(), 0.0
        )
        return str(decision.chosen), decision.reason

    assert route(10, 5) == ("b", "imbalanced")  # 5 > 4 and 10 > 7.5
    assert route(10, 7) == ("a", "prefix_match")  # 3 <= 4
    assert route(20, 15) == ("a", "prefix_match")  # 5 > 4 but 20 <= 22.5
    assert route(0, 0) == ("a", "prefix_match")


def test_match_rate_must_exceed_the_cache_threshold() -> None:
    sg = sglang(cache_threshold=0.3)
    sg.on_routed(request(1, 2, 3, 4), rid("a"), 0.0)
    replicas = [snap("a", running=3), snap("b", running=1), snap("c", running=2)]
    three_of_ten = request(1, 2, 3, *range(50, 57))
    four_of_ten = request(1, 2, 3, 4, *range(50, 56))
    decision = sg.route(three_of_ten, replicas, view(), 0.0)  # 0.3 is not above 0.3
    assert (str(decision.chosen), decision.reason) == ("b", "least_loaded")
    decision = sg.route(four_of_ten, replicas, view(), 0.0)
    assert (str(decision.chosen), decision.reason) == ("a", "prefix_match")


def test_match_ties_go_to_the_lower_load_and_hits_are_ignored() -> None:
    sg = sglang()
    sg.on_routed(request(1, 2), rid("a"), 0.0)
    sg.on_routed(request(1, 2), rid("b"), 0.0)
    replicas = [snap("a", running=2), snap("b", running=1), snap("c")]
    assert str(sg.route(request(1, 2), replicas, view(c=hit(gpu=2)), 0.0).chosen) == "b"


def test_whatever_path_routes_it_the_prompt_is_recorded_for_the_chosen_replica() -> None:
    sg = sglang(balance_abs_threshold=1, balance_rel_threshold=1.0)
    replicas = [snap("a", running=5), snap("b")]
    decision = sg.route(request(7, 8), replicas, view(), 0.0)
    assert decision.reason == "imbalanced"
    sg.on_routed(request(7, 8), decision.chosen, 0.0)
    decision = sg.route(request(7, 8), fleet("a", "b"), view(), 0.0)
    assert (str(decision.chosen), decision.reason) == ("b", "prefix_match")


def test_each_tree_is_evicted_lru_leaf_first_to_max_tree_blocks() -> None:
    sg = sglang(max_tree_blocks=4)
    sg.on_routed(request(1, 2, 3), rid("a"), 0.0)
    sg.on_routed(request(5, 6), rid("a"), 0.0)  # 5 blocks > 4: the oldest leaf (1,2,3) goes
    assert sg.tree.size(rid("a")) == 4
    assert sg.tree.match(rid("a"), request(1, 2, 3).key.block_hashes) == 2
    assert sg.tree.match(rid("a"), request(5, 6).key.block_hashes) == 2
