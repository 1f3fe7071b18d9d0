"""The KV connector's layer-by-layer loads: a step's CPU-tier loads copied into the engine's
cache one layer at a time on a thread of their own, while the forward pass runs.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer reads the cache; it waits
only for that layer's copy, so the copies of the later layers overlap the compute of the earlier
ones (Strata's overlap of transfer and compute, here with a worker thread; vLLM's CUDA
connectors use a side stream the same way). A loading request joins the batch at once instead
of waiting outside it for a whole load. Only memory copies run here, never a disk read: the
planner sends disk and shared-folder loads beside the batch (``loader.py``).

The copies and the forward pass touch different engine blocks (the loaded prefix against the
new tokens' slots), and the slab slots stay pinned for the step, so the only ordering needed is
the per-layer wait; ``finish`` waits for all of them before the step's stores touch the slab.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Batch = TypeVar("Batch")


class LayerCopier(Generic[Batch]):
    def __init__(
        self, layer_names: Sequence[str], copy_layer: Callable[[Batch, int], None]
    ) -> None:
        self._index = {name: index for index, name in enumerate(layer_names)}
        self._num_layers = len(layer_names)
        self._copy = copy_layer
        # One thread: tasks run in submission order, so layer i is done once its future is.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixmesh-kv-layers")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self.batches = 0
        """Steps that loaded layer by layer (for tests and reports)."""

    def start(self, batch: Batch) -> None:
        """Copy ``batch`` layer by layer, from the first layer on."""
        self.finish()
        with self._lock:
            self._pending = [
                self._pool.submit(self._copy, batch, layer) for layer in range(self._num_layers)
            ]
            self.batches += 1

    def wait(self, layer_name: str) -> None:
        """Return once ``layer_name``'s blocks are in (at once if this step loads nothing, or
        the layer is not one of the registered ones); a copy's error is raised here."""
        index = self._index.get(layer_name)
        with self._lock:
            pending = self._pending
        if index is not None and index < len(pending):
            pending[index].result()

    def finish(self) -> None:
        """Wait for every layer of the step in progress (before the slab changes)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
