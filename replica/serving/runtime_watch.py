"""A replica process's watch on its own pauses: freezes the startup heap once the engine is up,
times every GC pass and event-loop lag, and moves the engine's token intervals into metrics.

Together they say where a stream's gap came from (``prefixmesh stream-bench``): the engine
(its intervals), this process (GC, loop lag), or the path between.
"""

from __future__ import annotations

import asyncio
import logging

from prefixmesh.metrics.runtime import RuntimeMetrics
from prefixmesh.pauses import GcPauseRecorder, freeze_startup_heap, sample_loop_lag
from prefixmesh.replica.engines.base import Engine
from prefixmesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

LOOP_LAG_INTERVAL_S = 0.05
DRAIN_INTERVAL_S = 1.0


class RuntimeWatch:
    def __init__(self, engine: Engine, metrics: RuntimeMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._gc = GcPauseRecorder(metrics.gc_pause)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Call once the engine has started: what exists then lives as long as the process."""
        frozen = freeze_startup_heap()
        logger.info("froze %d startup objects out of garbage collection", frozen)
        self._gc.install()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(sample_loop_lag(self._metrics.loop_lag, LOOP_LAG_INTERVAL_S)),
            loop.create_task(self._drain_periodically()),
        ]

    def drain(self) -> None:
        """The engine's token intervals so far into the metrics (also before a scrape)."""
        self._metrics.engine_intervals(self._engine.take_token_intervals())

    async def _drain_periodically(self) -> None:
        while True:
            await asyncio.sleep(DRAIN_INTERVAL_S)
            self.drain()

    async def stop(self) -> None:
        self._gc.uninstall()
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []
