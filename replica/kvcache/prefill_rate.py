"""The engine's prefill rate, measured from its own steps on the KV connector's scheduler side
(pure: the caller gives the times), for the load-or-recompute choice (``LoadCosts``).

vLLM's engine core schedules a step, runs it, and schedules the next one at once while any
request is still running; it waits for new input only when none is. So when some request of
one step is scheduled again in the next, the time between the two schedules is the first step's
duration, with no idle time in it. A step that ran at least ``min_tokens`` tokens (mostly
prefill: a decode step runs one token a request) gives a sample of seconds per token; the rate
is the inverse of their exponentially weighted mean. Until the first sample the given initial
rate stands (a configured guess, or a calibration's).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Step:
    time_s: float
    requests: frozenset[str]
    tokens: int


class PrefillRateMeter:
    def __init__(self, initial_tokens_per_s: float, min_tokens: int, weight: float = 0.25) -> None:
        if initial_tokens_per_s <= 0 or min_tokens <= 0 or not 0 < weight <= 1:
            raise ValueError("the initial rate and min_tokens must be > 0, weight in (0, 1]")
        self._s_per_token = 1.0 / initial_tokens_per_s
        self._min_tokens = min_tokens
        self._weight = weight
        self._last: _Step | None = None
        self.samples = 0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self._s_per_token

    def scheduled(self, now_s: float, requests: Set[str], tokens: int) -> float:
        """A step was scheduled at ``now_s`` with ``tokens`` tokens of ``requests``; returns the
        rate as it stands after it."""
        last = self._last
        if (
            last is not None
            and last.tokens >= self._min_tokens
            and now_s > last.time_s
            and not last.requests.isdisjoint(requests)
        ):
            sample = (now_s - last.time_s) / last.tokens
            self._s_per_token += self._weight * (sample - self._s_per_token)
            self.samples += 1
        self._last = _Step(now_s, frozenset(requests), tokens) if tokens > 0 else None
        return self.tokens_per_s
