"""The running cost learned from finished requests (``decode_cost.py``)."""

from __future__ import annotations

import pytest

from prefixmesh.router.policy.decode_cost import DecodeCost


def learner(**overrides: float) -> DecodeCost:
    settings = {"window": 8, "max_cost": 10.0, "min_output_tokens": 4, "max_tracked": 100}
    return DecodeCost(**(settings | overrides))  # type: ignore[arg-type]


def test_the_running_cost_is_the_step_time_running_requests_add_per_token_compute() -> None:
    cost = learner()
    # Routed with 10 running (x 1 ms token compute) on a replica whose fixed step is 10 ms;
    # 101 tokens came out 0.05 s (the estimated TTFT) + 100 steps of 40 ms after routing.
    for n in range(4):
        cost.routed(f"r{n}", 0.0, 0.05, 0.010, 10 * 0.001, 101)
        if n < 2:
            assert cost.value == 1.0  # too few samples yet
        cost.finished(f"r{n}", 101, 0.05 + 100 * 0.040)
    # Each running request added 3 ms a step: three token computes.
    assert cost.value == pytest.approx(3.0)


def test_the_running_cost_is_clipped_and_needs_enough_samples() -> None:
    cost = learner(max_cost=2.0)
    for n in range(3):
        cost.routed(f"r{n}", 0.0, 0.0, 0.010, 0.010, 101)
        cost.finished(f"r{n}", 101, 100 * 0.5)
    assert cost.value == 2.0
    short = learner()
    short.routed("a", 0.0, 0.0, 0.010, 0.010, 3)  # too few tokens for a sample
    short.finished("a", 3, 10.0)
    short.finished("unknown", 50, 10.0)
    assert short.value == 1.0


def test_unreported_finishes_cost_bounded_memory() -> None:
    cost = learner(max_tracked=5)
    for n in range(50):
        cost.routed(f"r{n}", 0.0, 0.0, 0.010, 0.010, 101)
    cost.finished("r0", 101, 5.0)  # long forgotten: no sample
    assert cost.value == 1.0
    assert len(cost._routed) == 5
