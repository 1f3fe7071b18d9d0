"""Where a serving process stops: garbage-collection passes and event-loop lag.

A full collection walks every tracked object. The startup heap of a replica (Ray, torch,
transformers, vLLM, FastAPI) is ~660,000 objects, and one full pass over it took 280 ms on the
2-core dev machine: a stream waits that long for its next event whenever one runs. vLLM's own
API server and engine core freeze their startup heap for that reason (``freeze_gc_heap``); our
replica and router processes do the same once they are ready (``freeze_startup_heap``), and
record every pass and every late wake-up of the event loop so a stall can be attributed.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

PauseSink = Callable[[int, float], None]
"""Receives (generation, seconds) for each collection pass."""
LagSink = Callable[[float, str], None]
"""Receives (seconds late, ``running`` or ``off_cpu``) for each wake-up."""


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation, which
    later collections skip; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauseRecorder:
    """A ``gc.callbacks`` hook that times each collection pass (clock injected for tests)."""

    def __init__(self, sink: PauseSink, clock: Callable[[], float] = time.perf_counter) -> None:
        self._sink = sink
        self._clock = clock
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            self._sink(int(info.get("generation", -1)), self._clock() - self._started)
            self._started = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


async def sample_loop_lag(
    sink: LagSink,
    interval_s: float = 0.05,
    *,
    clock: Callable[[], float] = time.monotonic,
    cpu_clock: Callable[[], float] = time.process_time,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    samples: int | None = None,
) -> None:
    """Sleep ``interval_s`` again and again and report how late each wake-up was: the time the
    loop spent on something else. The process's CPU time over the same span says which kind:
    ``running`` (it ran code meanwhile: a blocking call, a GC pass, a long callback) or
    ``off_cpu`` (it was not scheduled: other processes had the cores, or it sat in a blocking
    system call). Runs until cancelled (or ``samples`` times, for tests)."""
    count = 0
    while samples is None or count < samples:
        before, cpu_before = clock(), cpu_clock()
        await sleep(interval_s)
        lag = max(0.0, clock() - before - interval_s)
        ran = cpu_clock() - cpu_before
        sink(lag, "running" if ran >= 0.5 * (lag + interval_s) else "off_cpu")
        count += 1
