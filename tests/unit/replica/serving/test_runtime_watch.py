from __future__ import annotations

import asyncio
import gc

from prefixmesh.metrics.runtime import RuntimeMetrics
from prefixmesh.metrics.sink import PrometheusSink
from prefixmesh.replica.engines.base import TokenIntervals
from prefixmesh.replica.serving.runtime_watch import RuntimeWatch


class _Engine:
    def __init__(self) -> None:
        self.intervals = TokenIntervals(limit=3)

    def take_token_intervals(self) -> tuple[float, ...]:
        return self.intervals.take()


def _sample(sink: PrometheusSink, name: str, **labels: str) -> float:
    return sink.registry.get_sample_value(name, labels) or 0.0


def test_token_intervals_are_taken_once_and_bounded() -> None:
    intervals = TokenIntervals(limit=3)
    intervals.add([0.1, 0.2, 0.3, 0.4])
    assert intervals.take() == (0.2, 0.3, 0.4)
    assert intervals.take() == ()


def test_the_watch_moves_engine_intervals_and_gc_passes_into_metrics() -> None:
    engine = _Engine()
    sink = PrometheusSink()
    watch = RuntimeWatch(engine, RuntimeMetrics(sink))  # type: ignore[arg-type]

    async def run() -> None:
        watch.start()
        try:
            engine.intervals.add([0.004, 0.006])
            watch.drain()
            gc.collect(0)
        finally:
            await watch.stop()

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()
    count = "prefixmesh_engine_token_interval_seconds_count"
    assert _sample(sink, count) == 2
    assert _sample(sink, "prefixmesh_gc_pause_seconds_count", generation="0") >= 1
    watch.drain()
    assert _sample(sink, count) == 2  # taken once
