from __future__ import annotations

import pytest

from prefixmesh.router.policy.history_tree import RoutingHistoryTree
from tests.unit.router.policy.builders import chain, rid

A, B = rid("a"), rid("b")


def test_match_counts_leading_blocks_per_tenant() -> None:
    tree = RoutingHistoryTree()
    tree.insert(A, chain(1, 2, 3))
    tree.insert(B, chain(1, 5))
    assert tree.match(A, chain(1, 2, 3, 4)) == 3
    assert tree.match(A, chain(1, 2, 7)) == 2
    assert tree.match(A, chain(9)) == 0
    assert tree.match(A, ()) == 0
    assert tree.match_all([A, B, rid("c")], chain(1, 5, 6)) == {A: 1, B: 2, rid("c"): 0}
    assert (tree.size(A), tree.size(B), tree.size(rid("c"))) == (3, 2, 0)


def test_lru_order_keeps_ancestors_newer_than_descendants() -> None:
    tree = RoutingHistoryTree()
    a1, a2, a3 = chain(1, 2, 3)
    d2 = chain(1, 4)[1]
    tree.insert(A, chain(1, 2, 3))
    assert tree.lru_order(A) == [a3, a2, a1]
    tree.insert(A, chain(1, 4))
    assert tree.lru_order(A) == [a3, a2, d2, a1]
    tree.insert(A, chain(1, 2))
    assert tree.lru_order(A) == [a3, d2, a2, a1]


def test_eviction_takes_least_recently_routed_leaves_and_keeps_chains_prefix_closed() -> None:
    tree = RoutingHistoryTree(max_blocks_per_tenant=3)
    tree.insert(A, chain(1, 2, 3))
    tree.insert(A, chain(1, 4))  # 4 blocks: (1,2,3)'s leaf goes
    assert tree.size(A) == 3
    assert tree.match(A, chain(1, 2, 3)) == 2
    tree.insert(A, chain(7))  # then (1,2)'s leaf
    assert tree.match(A, chain(1, 2, 3)) == 1
    assert tree.match(A, chain(1, 4)) == 2
    assert tree.match(A, chain(7)) == 1
    tree.remove(A)
    assert tree.size(A) == 0 and tree.tenants() == []


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_blocks_per_tenant"):
        RoutingHistoryTree(max_blocks_per_tenant=-1)
