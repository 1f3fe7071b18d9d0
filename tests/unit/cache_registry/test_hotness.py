from __future__ import annotations

import math

import pytest

from prefixmesh.cache_registry.hotness import DecayedCount, decayed_value, rate_per_s, touched


def test_value_halves_every_half_life() -> None:
    count = DecayedCount(8.0, 100.0)
    assert decayed_value(count, 110.0, half_life_s=10.0) == pytest.approx(4.0)
    assert decayed_value(count, 130.0, half_life_s=10.0) == pytest.approx(1.0)
    assert decayed_value(count, 90.0, half_life_s=10.0) == 8.0  # clocks never run backwards


def test_steady_stream_reports_its_rate() -> None:
    count = None
    for i in range(2000):  # 5 touches per second for 400 s, half-life 20 s
        count = touched(count, 1.0, i * 0.2, half_life_s=20.0)
    assert rate_per_s(count, 2000 * 0.2, half_life_s=20.0) == pytest.approx(5.0, rel=0.05)


def test_late_touch_keeps_the_newest_time() -> None:
    count = touched(None, 1.0, 100.0, 10.0)
    late = touched(count, 1.0, 90.0, 10.0)  # another router's clock is a bit behind
    assert late == DecayedCount(2.0, 100.0)
    assert rate_per_s(None, 0.0, 10.0) == 0.0
    assert rate_per_s(late, 100.0, 10.0) == pytest.approx(2.0 * math.log(2) / 10.0)
