"""The engine's prefill rate, measured from its own steps on the KV connector's scheduler side
(pure: the caller gives the times), for the load-or-recompute choice (``LoadCosts``).

vLLM's engine core schedules a step, runs it, and schedules the next one at once while any
request is still running; it waits for new input only when none is. So when some request of
one step is scheduled again in the next, the time between the two schedules is the first step's
duration, with no idle time in it. A step that ran at least ``min_tokens`` tokens (mostly
prefill: a decode step runs one token a request) gives a sample of seconds per token; the rate
is the inverse of their exponentially weighted mean. Until the first sample the given initial
rate stands (a configured guess, or a calibration's). A smaller step (the running batch's
decode, mostly) gives a sample of a step's own duration: the compute a step carries before any
new request joins it, which hides the copies of that step's layer-by-layer loads. A step with
loads in it samples neither: its forward pass may have waited for a copy.
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
        self._decode_step_s = 0.0
        self.decode_samples = 0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self._s_per_token

    @property
    def decode_step_s(self) -> float:
        """Seconds a step of fewer than ``min_tokens`` tokens takes (0 until one is timed)."""
        return self._decode_step_s

    def scheduled(
        self, now_s: float, requests: Set[str], tokens: int, *, loads: bool = False
    ) -> float:
        """A step was scheduled at ``now_s`` with ``tokens`` tokens of ``requests``; returns the
        rate as it stands after it. A step with ``loads`` in it (copies its forward pass may
        wait for) is no sample of compute."""
        last = self._last
        if last is not None and now_s > last.time_s and not last.requests.isdisjoint(requests):
            step_s = now_s - last.time_s
            if last.tokens >= self._min_tokens:
                sample = step_s / last.tokens
                self._s_per_token += self._weight * (sample - self._s_per_token)
                self.samples += 1
            elif self.decode_samples:
                self._decode_step_s += self._weight * (step_s - self._decode_step_s)
                self.decode_samples += 1
            else:
                self._decode_step_s = step_s
                self.decode_samples = 1
        self._last = _Step(now_s, frozenset(requests), tokens) if tokens and not loads else None
        return self.tokens_per_s
