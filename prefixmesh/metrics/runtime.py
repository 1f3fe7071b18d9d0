"""Where time goes inside a serving process: the engine's own token intervals, GC passes and
event-loop lag (``prefixmesh stream-bench`` reads them next to what a client saw)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prefixmesh.metrics.spec import HistogramSpec

if TYPE_CHECKING:
    from prefixmesh.metrics.sink import MetricSink

# Fine at the low end: a decode step is 1-20 ms on CPU, well under 1 ms on a GPU.
_INTERVAL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
)  # fmt: skip
_PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)

ENGINE_TOKEN_INTERVAL = HistogramSpec(
    "prefixmesh_engine_token_interval_seconds",
    "Interval between a request's consecutive output tokens as the engine timed it (vLLM: "
    "engine-core timestamps)",
    _INTERVAL_BUCKETS,
)
GC_PAUSE = HistogramSpec(
    "prefixmesh_gc_pause_seconds",
    "Duration of each garbage-collection pass in this process, by generation",
    _PAUSE_BUCKETS,
    ("generation",),
)
LOOP_LAG = HistogramSpec(
    "prefixmesh_event_loop_lag_seconds",
    "How late the event loop woke a sleeper sampled every 50 ms, by whether the process ran "
    "meanwhile (running: blocking code, GC) or was not scheduled (off_cpu: the cores were busy)",
    _PAUSE_BUCKETS,
    ("cause",),
)
RUNTIME_METRICS = (ENGINE_TOKEN_INTERVAL, GC_PAUSE, LOOP_LAG)


class RuntimeMetrics:
    def __init__(self, sink: MetricSink) -> None:
        self._engine_interval = ENGINE_TOKEN_INTERVAL.build(sink)
        self._gc_pause = GC_PAUSE.build(sink)
        self._loop_lag = LOOP_LAG.build(sink)

    def engine_intervals(self, seconds: Iterable[float]) -> None:
        for value in seconds:
            self._engine_interval.observe(value)

    def gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pause.labels(generation=str(generation)).observe(seconds)

    def loop_lag(self, seconds: float, cause: str) -> None:
        self._loop_lag.labels(cause=cause).observe(seconds)
