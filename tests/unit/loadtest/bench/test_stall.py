"""The stall check's arithmetic: which decode steps count as during a load, which as idle."""

from __future__ import annotations

import pytest

from prefixmesh.loadtest.bench.stall import StallResult, classify_steps


def test_steps_are_split_by_the_load_windows_they_end_in() -> None:
    # One decoder, a step every 10 ms, then one 40 ms step inside the load window [0.1, 0.2].
    arrivals = [[(0.00, 1), (0.01, 1), (0.02, 1), (0.13, 1), (0.17, 1), (0.30, 1), (0.31, 1)]]
    during, idle = classify_steps(arrivals, [(0.10, 0.20)])
    assert during == pytest.approx([110.0, 40.0])
    # 0.30 comes 130 ms after the previous token, which ended in the window: not idle either.
    assert idle == pytest.approx([10.0, 10.0, 10.0])


def test_a_chunk_of_several_tokens_counts_as_that_many_steps() -> None:
    during, idle = classify_steps([[(0.0, 1), (0.03, 3)]], [])
    assert during == [] and idle == pytest.approx([10.0, 10.0, 10.0])


def test_the_ratio_and_the_load_length_in_steps() -> None:
    result = StallResult("async", "disk", 2048, 36864, [120.0, 100.0, 80.0], [2048] * 3,
                         650.0, [11.0, 12.0, 13.0], [10.0, 10.0, 9.0])  # fmt: skip
    assert result.decode_step_ratio == pytest.approx(1.2)
    assert result.load_to_step == pytest.approx(10.0)
    assert result.summary()["load_mib"] == 72.0
