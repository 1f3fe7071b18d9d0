"""Open-loop arrivals: each request launches on its schedule, whatever earlier ones are doing.

Locust's ``wait_time`` is closed loop (a user waits for its response before its next task), so
the load generator runs one scheduler that sleeps until each arrival is due and spawns the
request, never waiting for a response. The clock, the sleep and the spawn are injected: the
locustfile passes gevent's, the tests a virtual clock. A scheduler that falls behind launches at
once and records how late it was (drift); it never skips or bunches arrivals silently.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def exponential_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival offsets of a Poisson process of ``rate`` per second (seeded)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(f"poisson/{seed}")
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def gaps(times: Sequence[float]) -> list[float]:
    ordered = sorted(times)
    return [b - a for a, b in itertools.pairwise(ordered)]


def arrival_cv(times: Sequence[float]) -> float:
    """Coefficient of variation (std / mean) of the gaps between arrivals: 1.0 for a Poisson
    process, 0 for a constant rate; NaN with fewer than three arrivals."""
    between = gaps(times)
    if len(between) < 2:
        return math.nan
    mean = sum(between) / len(between)
    if mean <= 0:
        return math.nan
    variance = sum((g - mean) ** 2 for g in between) / len(between)
    return math.sqrt(variance) / mean


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Launch:
    index: int
    scheduled_s: float
    """When it was due, from the start of the run."""
    launched_s: float
    """When it was launched, from the start of the run."""

    @property
    def drift_s(self) -> float:
        return self.launched_s - self.scheduled_s


class OpenLoopScheduler:
    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], object]) -> None:
        self._clock = clock
        self._sleep = sleep

    def run(
        self,
        offsets: Sequence[float],
        launch: Callable[[int, float], object],
        *,
        prepare: Callable[[int], object] | None = None,
        stop: Callable[[], bool] | None = None,
        until_s: float | None = None,
    ) -> list[Launch]:
        """Launch item i at ``start + offsets[i]`` (offsets ascending) by calling
        ``launch(i, start)``, which must not block (spawn a greenlet). ``prepare(i)`` runs before
        the wait, so building a request never delays its launch. Stops before an arrival past
        ``until_s`` or when ``stop()`` says so."""
        start = self._clock()
        launches: list[Launch] = []
        for index, offset in enumerate(offsets):
            if (until_s is not None and offset > until_s) or (stop is not None and stop()):
                break
            if prepare is not None:
                prepare(index)
            wait = start + offset - self._clock()
            if wait > 0:
                self._sleep(wait)
            launched = self._clock() - start
            launch(index, start)
            launches.append(Launch(index, offset, launched))
        return launches
