from __future__ import annotations

import pytest

from prefixmesh.router.policy.dynamo import DynamoPolicy
from tests.unit.router.policy.builders import chosen_ids, fleet, hit, policy, request, snap, view

# A 32-token prompt (8 blocks of 4) with 8 output tokens: it adds 8 prefill blocks and
# (32 + 8) / 4 = 10 decode blocks wherever it goes.
REQUEST = request(*range(8), output=8)
REPLICAS = [
    snap("a", pending=16, kv=10),  # raw prefill 4 + 8 = 12
    snap("b", kv=20),  # raw 8
    snap("c", pending=8, kv=4),  # raw 10
    snap("d", kv=12),  # raw 8, no hit
]
VIEW = view(a=hit(gpu=6), b=hit(cpu=8), c=hit(disk=8))


def dynamo(seed: int = 0, **section: object) -> DynamoPolicy:
    built = policy("dynamo", seed, **section)
    assert isinstance(built, DynamoPolicy)
    return built


def test_worked_example_with_tier_credits() -> None:
    # a: 12 - 6x1.0 = 6 + (10 + 10) = 26; b: 8 - 8x0.75 = 2 + 30 = 32;
    # c: 10 - 8x0.25 = 8 + 14 = 22; d: 8 + 22 = 30.
    assert dynamo().costs(REQUEST, REPLICAS, VIEW) == pytest.approx([26, 32, 22, 30])
    decision = dynamo().route(REQUEST, REPLICAS, VIEW, 0.0)
    assert chosen_ids(decision.ranked) == ["c", "a", "d", "b"]
    # prefill_load_scale weighs only the prefill term: a 12 + 20 = 32, c 16 + 14 = 30.
    assert dynamo(prefill_load_scale=2.0).costs(REQUEST, REPLICAS, VIEW) == pytest.approx(
        [32, 34, 30, 38]
    )


def test_credit_never_makes_prefill_negative_and_speculative_counts_as_gpu() -> None:
    replicas = [snap("a"), snap("b")]
    big = view(a=hit(gpu=8, speculative=8), b=hit(gpu=4))
    # a: max(8 - 8, 0) + 10 = 10 ; b: 8 - 4 = 4 + 10 = 14
    assert dynamo().costs(REQUEST, replicas, big) == pytest.approx([10, 14])


def test_ties_are_broken_at_random() -> None:
    chosen = {
        str(dynamo(seed).route(REQUEST, fleet("a", "b", "c"), view(), 0.0).chosen)
        for seed in range(20)
    }
    assert chosen == {"a", "b", "c"}
