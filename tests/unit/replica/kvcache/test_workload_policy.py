"""The workload-aware policy: online per-category fits, O(categories) victims, exact orders."""

from __future__ import annotations

import math

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import WorkloadAwareConfig
from prefixmesh.replica.kvcache.policy import ManualClock, ReuseFit, WorkloadAwarePolicy

from .chains import eviction_order, use


def workload(clock: ManualClock, **overrides: object) -> WorkloadAwarePolicy:
    settings: dict[str, object] = {"min_samples": 2, "refit_interval_s": 0.001}
    settings.update(overrides)
    return WorkloadAwarePolicy(WorkloadAwareConfig(**settings), clock=clock)


def test_paper_defaults() -> None:
    config = WorkloadAwareConfig()
    assert config.fit_window_s == 3600.0
    assert config.lifespan_regulator


def test_reuse_probability_is_conditional_on_the_idle_time_and_cut_at_the_lifespan() -> None:
    fit = ReuseFit(p=0.5, rate=0.1, life_s=30.0, samples=10)
    x = 0.5 * math.exp(-1.0)
    assert fit.probability(10.0) == pytest.approx(x / (x + 0.5))
    assert fit.probability(0.0) == pytest.approx(0.5)
    assert fit.probability(31.0) == 0.0
    assert ReuseFit(p=1.0, rate=0.1, life_s=math.inf, samples=1).probability(100.0) == 1.0


def test_each_category_fits_rate_share_and_lifespan_from_its_reuses() -> None:
    clock = ManualClock()
    policy = workload(clock)
    use(policy, [1, 2], "a")  # t = 0: 2 accesses
    clock.set(10.0)
    use(policy, [1], "a")  # reuse after 10 s
    clock.set(30.0)
    use(policy, [1], "a")  # reuse after 20 s; 4 accesses, 2 reused
    fit = policy.model.fit("a")
    assert (fit.p, fit.rate, fit.life_s, fit.samples) == (0.5, pytest.approx(1 / 15), 20.0, 2)
    assert policy.model.fit("unseen") == fit  # too few samples: the fit of all categories
    assert policy.category_of(BlockHash(2)) == "a"


def test_old_samples_leave_the_window() -> None:
    clock = ManualClock()
    policy = workload(clock, fit_window_s=15.0)
    use(policy, [1], "a")
    clock.set(1.0)
    use(policy, [1], "a")
    clock.set(2.0)
    use(policy, [1], "a")
    assert policy.model.fit("a").samples == 2
    clock.set(100.0)
    use(policy, [9], "a")
    assert policy.model.fit("a").samples == 2  # the last fit stands until enough samples again


def test_before_any_fit_the_policy_is_lru_with_the_tail_first() -> None:
    clock = ManualClock()
    policy = workload(clock)
    held: set[int] = set()
    use(policy, [1, 2, 3], "a", resident=held)
    clock.set(1.0)
    use(policy, [4, 5], "b", resident=held)
    assert eviction_order(policy) == [3, 2, 1, 5, 4]


def test_the_less_likely_category_goes_first_whatever_its_recency() -> None:
    clock = ManualClock()
    policy = workload(clock, lifespan_regulator=False)
    held: set[int] = set()
    # Category "hot": blocks reused every 5 s; "cold": reused once after 100 s.
    for step in range(4):
        clock.set(step * 5.0)
        use(policy, [1, 2], "hot", resident=held)
    clock.set(20.0)
    use(policy, [10, 11], "cold", resident=held)
    clock.set(120.0)
    use(policy, [10, 11], "cold", resident=held)
    clock.set(121.0)
    use(policy, [20], "cold", resident=held)
    use(policy, [21], "cold", resident=held)
    hot, cold = policy.model.fit("hot"), policy.model.fit("cold")
    assert hot.rate == pytest.approx(1 / 5) and cold.rate == pytest.approx(1 / 100)
    clock.set(125.0)
    # hot blocks idle 110 s: 0.75 e^-22 ~ 0; cold blocks idle 5 s or less: near their p.
    assert policy.reuse_probability(BlockHash(1)) < policy.reuse_probability(BlockHash(20))
    assert eviction_order(policy) == [2, 1, 11, 10, 20, 21]


def test_equal_probabilities_evict_the_deeper_block_first() -> None:
    clock = ManualClock()
    policy = workload(clock, lifespan_quantile=0.5)
    held: set[int] = set()
    use(policy, [1, 2], "a", resident=held)
    clock.set(1.0)
    use(policy, [1, 2], "a", resident=held)
    clock.set(2.0)
    use(policy, [1, 2], "a", resident=held)  # lifespan: 1 s
    use(policy, [5, 6, 7], "b", resident=held)
    clock.set(50.0)  # everything is past its lifespan: probability 0 for all
    assert {policy.reuse_probability(BlockHash(b)) for b in (1, 2, 5, 6, 7)} == {0.0}
    assert eviction_order(policy) == [7, 2, 6, 1, 5]
