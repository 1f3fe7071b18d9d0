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

Promotions ahead of need (``Prefetch``: a waiting request's disk blocks read into the CPU tier)
run here as well, but only while no request's load waits: a load never queues behind one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.plan import LoadJob, Prefetch, RequestLoad

logger = logging.getLogger(__name__)

LoadFn = Callable[[Sequence[LoadJob]], list[LoadJob]]
"""Runs the jobs and returns those that failed (``TierStore.load``)."""
PrefetchFn = Callable[[Prefetch], list[BlockHash]]
"""Runs a promotion and returns the blocks that failed (``TierStore.prefetch``)."""


class BackgroundLoader:
    def __init__(
        self,
        load: LoadFn,
        *,
        nice: int,
        device: torch.device,
        prefetch: PrefetchFn,
    ) -> None:
        self._load = load
        self._prefetch = prefetch
        self._nice = nice
        self._device = device
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: list[LoadJob] = []
        self._prefetched: dict[int, list[BlockHash]] = {}
        self._ready = threading.Condition(self._lock)
        self._loads: deque[RequestLoad] = deque()
        self._prefetches: deque[Prefetch] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixmesh-kv-loader", daemon=True)
        self._thread.start()

    def submit(self, load: RequestLoad) -> None:
        with self._ready:
            self._loads.append(load)
            self._ready.notify()

    def submit_prefetch(self, prefetch: Prefetch) -> None:
        """Run ``prefetch`` once no request's load waits."""
        with self._ready:
            self._prefetches.append(prefetch)
            self._ready.notify()

    def take_done(self) -> tuple[set[str], list[LoadJob]]:
        """Requests whose loads finished since the last call, and the jobs among them that
        failed (their engine blocks must be recomputed)."""
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, []
        return done, failed

    def take_prefetched(self) -> dict[int, list[BlockHash]]:
        """Promotions that ran since the last call: batch -> the blocks that failed."""
        with self._lock:
            prefetched, self._prefetched = self._prefetched, {}
        return prefetched

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=10.0)

    def _next(self) -> RequestLoad | Prefetch | None:
        with self._ready:
            while not (self._closed or self._loads or self._prefetches):
                self._ready.wait()
            if self._closed:
                return None
            return self._loads.popleft() if self._loads else self._prefetches.popleft()

    def _run(self) -> None:
        if sys.platform == "linux" and self._nice:
            with contextlib.suppress(OSError):  # a container may forbid it: run at the default
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        cuda = self._device.type == "cuda"
        stream = torch.cuda.Stream(self._device) if cuda else None  # type: ignore[no-untyped-call]
        while (load := self._next()) is not None:
            if isinstance(load, Prefetch):
                self._run_prefetch(load)
                continue
            try:
                failed = self._run_one(load.jobs, stream)
            except Exception:  # a failed load is recomputed, never a dead loader
                logger.exception("KV load of request %s failed", load.request_id)
                failed = list(load.jobs)
            with self._lock:
                self._failed += failed
                self._done.add(load.request_id)

    def _run_prefetch(self, prefetch: Prefetch) -> None:
        try:
            failed = self._prefetch(prefetch)
        except Exception:  # a failed promotion leaves the blocks on disk
            logger.exception("KV promotion %d failed", prefetch.batch)
            failed = list(prefetch.blocks)
        with self._lock:
            self._prefetched[prefetch.batch] = failed

    def _run_one(self, jobs: Sequence[LoadJob], stream: torch.cuda.Stream | None) -> list[LoadJob]:
        if stream is None:
            return self._load(jobs)
        with torch.cuda.stream(stream):
            failed = self._load(jobs)
        stream.synchronize()
        return failed
