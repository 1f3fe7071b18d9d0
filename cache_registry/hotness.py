"""Exponentially decayed counters: the traffic measure behind affinity groups.

A counter holds a value and the time it was last updated. A touch of weight w at time t makes
it v * 2**(-(t - t0) / half_life) + w. For a steady stream of r touches per second of weight 1
the value settles at r * half_life / ln 2, so ``rate`` reports value * ln 2 / half_life.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecayedCount:
    value: float
    updated_s: float


def decayed_value(count: DecayedCount, now_s: float, half_life_s: float) -> float:
    elapsed = max(0.0, now_s - count.updated_s)
    return count.value * math.exp2(-elapsed / half_life_s)


def touched(
    count: DecayedCount | None, weight: float, now_s: float, half_life_s: float
) -> DecayedCount:
    base = 0.0 if count is None else decayed_value(count, now_s, half_life_s)
    return DecayedCount(base + weight, max(now_s, count.updated_s) if count else now_s)


def rate_per_s(count: DecayedCount | None, now_s: float, half_life_s: float) -> float:
    if count is None:
        return 0.0
    return decayed_value(count, now_s, half_life_s) * math.log(2) / half_life_s
