from __future__ import annotations

import pytest

from tests.unit.router.policy.builders import chosen_ids, fleet, hit, policy, request, snap, view


def test_round_robin_cycles_through_the_candidate_list_in_order() -> None:
    rr = policy("round_robin")
    replicas = fleet("a", "b", "c")
    decisions = [rr.route(request(1), replicas, view(), 0.0) for _ in range(4)]
    assert [str(d.chosen) for d in decisions] == ["a", "b", "c", "a"]
    assert chosen_ids(decisions[1].ranked) == ["b", "c", "a"]  # the list, rotated
    assert decisions[0].hold is None and decisions[0].reason == "round_robin"


def test_round_robin_follows_a_changing_fleet() -> None:
    rr = policy("round_robin")
    assert str(rr.route(request(1), fleet("a", "b", "c"), view(), 0.0).chosen) == "a"
    assert str(rr.route(request(1), fleet("a", "b", "c"), view(), 0.0).chosen) == "b"
    assert str(rr.route(request(1), fleet("a", "c"), view(), 0.0).chosen) == "a"  # 2 % 2
    assert str(rr.route(request(1), fleet("a", "c", "d"), view(), 0.0).chosen) == "c"  # 1 % 3


def test_pow2_puts_the_replica_with_fewer_ongoing_requests_first() -> None:
    replicas = [snap("a", queued=2, running=1), snap("b", running=1)]
    for seed in range(10):
        decision = policy("pow2", seed).route(request(1), replicas, view(), 0.0)
        assert chosen_ids(decision.ranked) == ["b", "a"]


def test_pow2_samples_two_distinct_replicas_and_breaks_ties_at_random() -> None:
    replicas = fleet("a", "b", "c", "d", "e")
    firsts = set()
    for seed in range(30):
        ranked = chosen_ids(policy("pow2", seed).route(request(1), replicas, view(), 0.0).ranked)
        assert len(ranked) == 2 and len(set(ranked)) == 2
        firsts.add(ranked[0])
    assert firsts == {"a", "b", "c", "d", "e"}
    one = policy("pow2", 7)
    again = policy("pow2", 7)
    first = [one.route(request(1), replicas, view(), 0.0).chosen for _ in range(10)]
    assert first == [again.route(request(1), replicas, view(), 0.0).chosen for _ in range(10)]


def test_pow2_with_one_replica_and_it_ignores_hits() -> None:
    assert chosen_ids(policy("pow2").route(request(1), fleet("a"), view(), 0.0).ranked) == ["a"]
    replicas = [snap("a", running=3), snap("b")]
    decision = policy("pow2").route(request(1, 2), replicas, view(a=hit(gpu=2)), 0.0)
    assert str(decision.chosen) == "b"


@pytest.mark.parametrize("name", ["round_robin", "pow2"])
def test_no_replicas_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match="no candidate replicas"):
        policy(name).route(request(1), [], view(), 0.0)
