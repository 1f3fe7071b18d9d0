"""The open-loop scheduler on a virtual clock: arrivals launch on schedule whatever earlier
requests are doing, late ones launch at once and say how late; gaps of a seeded Poisson process
are exponential (coefficient of variation 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prefixmesh.loadtest.poisson import (
    OpenLoopScheduler,
    arrival_cv,
    exponential_arrivals,
    gaps,
    percentile,
)
from prefixmesh.loadtest.workloads import GroupsWorkload
from tests.fakes.clock import FakeClock


def test_seeded_poisson_gaps_are_exponential_at_the_rate() -> None:
    times = exponential_arrivals(200.0, 20_000, seed=7)
    assert times == exponential_arrivals(200.0, 20_000, seed=7)
    assert times != exponential_arrivals(200.0, 20_000, seed=8)
    between = np.array(gaps(times))
    assert between.min() >= 0
    assert abs(between.mean() - 1 / 200) < 0.03 / 200
    assert abs(arrival_cv(times) - 1.0) < 0.03
    # the exponential's median is ln 2 / rate, its 99th percentile ln 100 / rate
    assert abs(np.median(between) - math.log(2) / 200) < 0.05 * math.log(2) / 200
    assert abs(np.percentile(between, 99) - math.log(100) / 200) < 0.08 * math.log(100) / 200


def test_the_workloads_arrivals_are_poisson_too() -> None:
    requests = GroupsWorkload(num_groups=4).generate(5000, 50.0, seed=3)
    assert abs(arrival_cv([r.arrival_s for r in requests]) - 1.0) < 0.05


def test_cv_of_regular_and_degenerate_arrivals() -> None:
    assert arrival_cv([0.0, 1.0, 2.0, 3.0]) == 0.0
    assert math.isnan(arrival_cv([0.0, 1.0]))
    assert arrival_cv([0.0, 0.0, 3.0]) == pytest.approx(1.0)  # gaps 0, 3: std 1.5, mean 1.5


def test_percentile_matches_numpy() -> None:
    values = [0.3, 0.1, 0.9, 0.4, 0.2, 0.7]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q * 100))
    assert math.isnan(percentile([], 0.5))


class VirtualTime:
    def __init__(self) -> None:
        self.clock = FakeClock(100.0)
        self.events: list[tuple[str, int, float]] = []

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)


def test_launches_on_schedule_without_waiting_for_earlier_requests() -> None:
    vt = VirtualTime()
    offsets = exponential_arrivals(100.0, 500, seed=1)

    def launch(index: int, start: float) -> None:
        # a request never completes within the test: open loop must not care
        vt.events.append(("launch", index, vt.clock() - start))

    launches = OpenLoopScheduler(vt.clock, vt.sleep).run(offsets, launch)
    assert [e[1] for e in vt.events] == list(range(500))
    assert [launch.launched_s for launch in launches] == pytest.approx(offsets)
    assert max(abs(launch.drift_s) for launch in launches) < 1e-9
    assert arrival_cv([launch.launched_s for launch in launches]) == pytest.approx(
        arrival_cv(offsets)
    )


def test_prepare_runs_before_the_wait_and_late_arrivals_launch_at_once() -> None:
    vt = VirtualTime()
    order: list[tuple[str, int, float]] = []

    def prepare(index: int) -> None:
        order.append(("prepare", index, vt.clock()))
        if index == 1:
            vt.clock.advance(0.25)  # building request 1 took long: it and 2 are late

    def launch(index: int, start: float) -> None:
        order.append(("launch", index, vt.clock() - start))

    launches = OpenLoopScheduler(vt.clock, vt.sleep).run(
        [0.1, 0.2, 0.3, 0.6], launch, prepare=prepare
    )
    assert [kind for kind, _, _ in order] == ["prepare", "launch"] * 4
    assert [round(launch.drift_s, 6) for launch in launches] == [0.0, 0.15, 0.05, 0.0]
    assert [launch.index for launch in launches] == [0, 1, 2, 3]  # none skipped


def test_stops_at_the_window_and_on_request() -> None:
    vt = VirtualTime()
    scheduler = OpenLoopScheduler(vt.clock, vt.sleep)
    launched: list[int] = []
    runs = scheduler.run([0.1, 0.5, 1.5, 2.5], lambda i, _: launched.append(i), until_s=2.0)
    assert [launch.index for launch in runs] == [0, 1, 2]
    calls = iter([False, False, True])
    runs = scheduler.run([0.1, 0.2, 0.3], lambda i, _: None, stop=lambda: next(calls))
    assert len(runs) == 2
