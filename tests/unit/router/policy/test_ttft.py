from __future__ import annotations

import random

import pytest

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.policy.base import ReplicaCapacity
from prefixmesh.router.policy.ttft import TtftModel, effective_prefill_rate
from tests.unit.router.policy.builders import CAPACITY, hit, request, snap


def model(**overrides: float) -> TtftModel:
    settings = {
        "block_size": 4,
        "min_prefill_share": 0.05,
        "cpu_fallback_credit": 0.75,
        "disk_fallback_credit": 0.25,
        "recompute_penalty": 0.5,
    } | overrides
    return TtftModel(**settings)  # type: ignore[arg-type]


def test_prefill_shares_each_step_with_the_running_decodes() -> None:
    # Budget 100 tokens, a full step takes 100 / 1000 = 0.1 s (> the 0.01 s decode floor).
    assert effective_prefill_rate(CAPACITY, 0, 0.05) == pytest.approx(1000)
    assert effective_prefill_rate(CAPACITY, 20, 0.05) == pytest.approx(800)
    assert effective_prefill_rate(CAPACITY, 500, 0.05) == pytest.approx(50)  # floor: 5 per step
    # Memory bound: a full budget computes in 0.1 ms but a step still takes 10 ms.
    fast = ReplicaCapacity(1_000_000.0, 0.01, 100, 1000)
    assert effective_prefill_rate(fast, 0, 0.05) == pytest.approx(10_000)


def test_ttft_is_queue_plus_uncached_prefill_plus_lower_tier_loads() -> None:
    capacity = ReplicaCapacity(1000.0, 0.01, 100, 1000, cpu_load_s_per_block=0.001)
    replica = snap("a", running=20, pending=200, capacity=capacity)  # 800 tokens/s
    # 10 blocks; GPU 4 + CPU 2 (loaded, 1 ms each) + disk 2 (no load time: credit 0.25)
    # -> saved 6.5 blocks = 26 tokens, 14 to compute.
    estimate = model().explain(request(*range(10)), replica, hit(gpu=4, cpu=2, disk=2))
    assert estimate.queue_wait_s == pytest.approx(0.25)
    assert estimate.uncached_tokens == 14
    assert estimate.prefill_s == pytest.approx(14 / 800)
    assert estimate.load_s == pytest.approx(0.002)
    assert estimate.ttft_s == pytest.approx(0.25 + 14 / 800 + 0.002)
    assert estimate.cost == pytest.approx(estimate.ttft_s + 0.5 * 14 / 800)


def test_first_token_takes_at_least_one_step_and_the_last_token_is_computed() -> None:
    estimate = model().explain(request(1, 2), snap("a"), hit(gpu=2))
    assert estimate.uncached_tokens == 1
    assert estimate.prefill_s == pytest.approx(0.01)


def test_a_hit_longer_than_the_prompt_is_trimmed_from_its_deepest_tier() -> None:
    estimate = model().explain(request(1, 2), snap("a"), hit(gpu=1, cpu=1, disk=3))
    # 2 prompt blocks: GPU 1 + CPU 1 kept (CPU credit 0.75 without a load time).
    assert estimate.uncached_tokens == round(8 - 1.75 * 4)


def test_bulk_estimate_matches_the_term_by_term_one() -> None:
    rng = random.Random(3)
    tiny = model()
    for _ in range(50):
        capacities = [
            ReplicaCapacity(
                rng.choice([500.0, 1000.0, 2000.0, 1e6]),
                rng.choice([0.0, 0.01, 0.2]),
                rng.choice([16, 100, 2048]),
                100,
                cpu_load_s_per_block=rng.choice([0.0, 0.002]),
            )
            for _ in range(6)
        ]
        replicas = [
            snap(f"r{i}", running=rng.randrange(40), pending=rng.randrange(500), capacity=c)
            for i, c in enumerate(capacities)
        ]
        req = request(*range(rng.randrange(1, 12)), extra_tokens=rng.randrange(4))
        hits = {
            ReplicaId(f"r{i}"): hit(gpu=rng.randrange(4), cpu=rng.randrange(3), speculative=0)
            for i in rng.sample(range(6), 3)
        }
        bulk = tiny.estimate(req, replicas, hits)
        for i, replica in enumerate(replicas):
            one = tiny.explain(req, replica, hits.get(replica.replica_id))
            assert bulk.queue_wait_s[i] == pytest.approx(one.queue_wait_s)
            assert bulk.cost[i] == pytest.approx(one.cost)
        for index, held, rate, uncached in bulk.holders:
            one = tiny.explain(req, replicas[index], held)
            assert uncached == one.uncached_tokens
            assert rate == pytest.approx(one.prefill_rate)


def test_zero_rates_in_a_report_do_not_divide_by_zero() -> None:
    broken = [
        snap("a", pending=10, capacity=ReplicaCapacity(0.0, 0.0, 0, 0)),
        snap("b", pending=10, capacity=CAPACITY),
    ]
    estimates = model().estimate(request(1, 2), broken, {})
    assert estimates.cost[0] > estimates.cost[1]
