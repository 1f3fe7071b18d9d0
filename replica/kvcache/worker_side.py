"""The KV connector's worker side (one per rank, in vLLM's worker process): runs each step's
``StepPlan`` on the ``TierStore``: loads before the forward pass (or layer by layer beside it,
``layer_loads.py``), asynchronous loads on the ``BackgroundLoader``, and stores, moves and drops
after it, then the step's promotions ahead of need (on the loader, into the slots those jobs
freed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import KVCacheConfig
from prefixmesh.kernels.ops import PagedKVCache
from prefixmesh.replica.kvcache.connector_stats import USABLE
from prefixmesh.replica.kvcache.disk import DiskTier
from prefixmesh.replica.kvcache.layer_loads import LayerCopier
from prefixmesh.replica.kvcache.loader import BackgroundLoader
from prefixmesh.replica.kvcache.plan import StepPlan
from prefixmesh.replica.kvcache.store import LayerBatch, TierStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerFolders:
    """Where this rank's tier files live."""

    disk: Path
    shared: Path
    layout_tag: str
    """What every file must carry (model, block size, hash seed, TP degree)."""


class WorkerSide:
    def __init__(self, settings: KVCacheConfig, folders: WorkerFolders, layerwise: bool) -> None:
        self._settings = settings
        self._folders = folders
        self._layerwise = layerwise
        self._store: TierStore | None = None
        self._loader: BackgroundLoader | None = None
        self._layers: LayerCopier[LayerBatch] | None = None
        self._failed: set[int] = set()
        self._states: dict[str, int] = {}
        self._write_errors = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cache = PagedKVCache.of(kv_caches)
        settings = self._settings
        page_bytes = cache.layout.page_bytes * cache.layout.num_layers
        tag = self._folders.layout_tag
        disk = shared = None
        if settings.disk_tier_gib > 0:
            disk = DiskTier(self._folders.disk, tag, page_bytes)
        if settings.shared_tier_gib > 0:
            shared_dir = self._folders.shared
            try:
                shared = DiskTier(shared_dir, tag, page_bytes, write_once=True, touch_on_read=True)
            except OSError as exc:  # its loads then fail and are recomputed
                logger.warning("no shared KV tier: %s cannot be used (%s)", shared_dir, exc)
                self._states[USABLE] = 0
        cpu_blocks = int(settings.cpu_tier_gib * 2**30) // page_bytes
        self._store = TierStore(cache, cpu_blocks, disk, shared)
        if settings.async_loads:
            self._loader = BackgroundLoader(
                self._store.load,
                prefetch=self._store.prefetch,
                nice=settings.load_thread_nice,
                device=cache.layout.device,
            )
        if self._layerwise:
            self._layers = LayerCopier(list(kv_caches), self._store.copy_layer)

    def load(self, plan: StepPlan) -> None:
        if self._store is None:
            return
        loads = plan.loads
        if loads and self._layers is not None:
            in_memory = [job for job in loads if job.from_memory]
            loads = tuple(job for job in loads if not job.from_memory)
            batch, missing = self._store.layer_batch(in_memory)
            self._failed.update(job.engine_block for job in missing)
            if batch is not None:
                self._layers.start(batch)
        if loads:
            failed = self._store.load(loads)
            self._failed.update(job.engine_block for job in failed)
        for load in plan.async_loads:
            if self._loader is None:  # the scheduler's settings are ours: never happens
                self._failed.update(job.engine_block for job in load.jobs)
                continue
            self._loader.submit(load)

    def wait_for_layer(self, layer_name: str) -> None:
        if self._layers is not None:
            self._layers.wait(layer_name)

    def finish_layers(self) -> None:
        if self._layers is not None:
            self._layers.finish()

    def take_loaded(self) -> set[str]:
        if self._loader is None:
            return set()
        done, failed = self._loader.take_done()
        self._failed.update(job.engine_block for job in failed)
        return done

    def run(self, plan: StepPlan) -> None:
        if plan.jobs and self._store is not None:
            self._store.run(plan.jobs)
        for prefetch in plan.prefetches:
            if self._loader is None:  # the scheduler's settings are ours: never happens
                continue
            self._loader.submit_prefetch(prefetch)

    def take_prefetched(self) -> dict[int, list[BlockHash]]:
        """Promotions run since the last call: batch -> the blocks that failed."""
        return self._loader.take_prefetched() if self._loader is not None else {}

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def stats(self) -> dict[str, int]:
        """Tier files that failed to be written since the last call, and any new state."""
        store = self._store
        errors = (
            0
            if store is None
            else sum(tier.write_errors for tier in (store.disk, store.shared) if tier is not None)
        )
        moved, self._write_errors = errors - self._write_errors, errors
        states, self._states = self._states, {}
        return {"write_errors": moved, **states} if moved else states

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._layers is not None:
            self._layers.close()
        if self._store is not None:
            self._store.close()
