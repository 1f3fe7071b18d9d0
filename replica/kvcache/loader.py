"""The KV connector's worker-side loader: runs requests' asynchronous loads (``RequestLoad``)
one after another on a thread of its own, beside the engine's steps.

The engine's forward pass and the loader touch different engine blocks (vLLM gives a loading
request fresh blocks and keeps it out of the batch until the load is reported done), and the
planner keeps the loading blocks pinned in their tier, so neither side waits for the other. The
thread runs at a lower priority than the engine (``load_thread_nice``, Linux: niceness is per
thread there), so on a machine whose cores the engine's compute threads fill, a load takes
what they leave and decode steps keep their pace. On CUDA the copies run on a side stream that
the thread waits on, never on the engine's stream. Disk reads happen here too, never on the
step path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from prefixmesh.replica.kvcache.planner import LoadJob, RequestLoad

logger = logging.getLogger(__name__)

LoadFn = Callable[[Sequence[LoadJob]], list[LoadJob]]
"""Runs the jobs and returns those that failed (``TierStore.load``)."""


class BackgroundLoader:
    def __init__(self, load: LoadFn, *, nice: int, device: torch.device) -> None:
        self._load = load
        self._nice = nice
        self._device = device
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: list[LoadJob] = []
        self._queue: queue.SimpleQueue[RequestLoad | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefixmesh-kv-loader", daemon=True)
        self._thread.start()

    def submit(self, load: RequestLoad) -> None:
        self._queue.put(load)

    def take_done(self) -> tuple[set[str], list[LoadJob]]:
        """Requests whose loads finished since the last call, and the jobs among them that
        failed (their engine blocks must be recomputed)."""
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, []
        return done, failed

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        if sys.platform == "linux" and self._nice:
            with contextlib.suppress(OSError):  # a container may forbid it: run at the default
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        while (load := self._queue.get()) is not None:
            try:
                failed = self._run_one(load.jobs, stream)
            except Exception:  # a failed load is recomputed, never a dead loader
                logger.exception("KV load of request %s failed", load.request_id)
                failed = list(load.jobs)
            with self._lock:
                self._failed += failed
                self._done.add(load.request_id)

    def _run_one(self, jobs: Sequence[LoadJob], stream: torch.cuda.Stream | None) -> list[LoadJob]:
        if stream is None:
            return self._load(jobs)
        with torch.cuda.stream(stream):
            failed = self._load(jobs)
        stream.synchronize()
        return failed
