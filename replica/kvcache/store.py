"""The KV connector's worker side: the block data of the lower tiers, and the copies between
them and the engine's paged KV cache, as the planner's ``StepPlan`` says.

The CPU tier is one preallocated slab of pages (pinned on CUDA machines, so copies to and from
the GPU run at link speed), ``[capacity, num_layers, *page_shape]`` in the page-first layout of
``prefixmesh.kernels``; a block is a slot in it. The disk tier is ``DiskTier`` (one file a
block, written in the background); the shared tier is a ``DiskTier`` on the folder every
replica shares (written once, ``ShareJob``; loads marked ``shared``). Every multi-block
transfer goes through ``gather_blocks`` / ``scatter_blocks``: one gather of all the step's
stored blocks into a device staging buffer, then one copy per run of consecutive slab slots;
for loads the reverse. A load that goes layer by layer (``layer_batch`` / ``copy_layer``, on a
copier thread) writes one layer of its blocks at a time with ``scatter_layer``. A promotion
ahead of need (``prefetch``, on the loader thread) reads disk files into free slab slots; the
slot table is the one thing both threads change, under a lock.
A slot holds all layers of a block contiguously (megabytes for an 8B model), so even a
fragmented slab moves at link speed, with no host-side copy in between.

On CUDA the copies are asynchronous on the current stream (the engine's), so loads and the
forward pass that reads them are ordered; the only host-side reader of the slab, a move to
disk, first waits for the stores enqueued before it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.kernels.ops import PagedKVCache, gather_blocks, scatter_blocks, scatter_layer
from prefixmesh.replica.kvcache.disk import DiskTier
from prefixmesh.replica.kvcache.plan import (
    DropJob,
    Job,
    LoadJob,
    MoveJob,
    Prefetch,
    ShareJob,
    StoreJob,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerBatch:
    """One step's CPU-tier loads, ready to copy layer by layer."""

    slots: torch.Tensor
    """Slab slots (int64, host)."""
    engine_blocks: torch.Tensor
    """The engine blocks they go to (int64, on the cache's device)."""


class TierStore:
    def __init__(
        self,
        cache: PagedKVCache,
        cpu_capacity_blocks: int,
        disk: DiskTier | None,
        shared: DiskTier | None = None,
    ) -> None:
        self.cache = cache
        layout = cache.layout
        self._page_shape = (layout.num_layers, *layout.page_shape)
        pin = layout.device.type == "cuda"
        self._slab = torch.empty(
            (max(0, cpu_capacity_blocks), *self._page_shape), dtype=layout.dtype, pin_memory=pin
        )
        self._slot: dict[BlockHash, int] = {}
        self._free = list(range(cpu_capacity_blocks - 1, -1, -1))
        self._slots_lock = threading.Lock()
        """Guards ``_slot`` and ``_free`` (the step's thread and the loader's change them)."""
        self._stores_done: torch.cuda.Event | None = None  # last async slab write (CUDA)
        self.disk = disk
        self.shared = shared
        self.page_bytes = layout.page_bytes * layout.num_layers

    @property
    def cpu_blocks(self) -> int:
        return len(self._slot)

    def holds(self, tier: Tier, block: BlockHash) -> bool:
        return tier is Tier.CPU and block in self._slot

    # ---- before the forward pass ---------------------------------------------------------------

    def load(self, loads: Sequence[LoadJob]) -> list[LoadJob]:
        """Write each job's block into its engine block; returns the jobs that failed (a block
        the worker does not have, a corrupt or missing file), whose engine blocks vLLM must
        recompute."""
        failed: list[LoadJob] = []
        device = self.cache.layout.device
        cpu = [job for job in loads if job.from_memory]
        disk = [job for job in loads if job.tier is Tier.DISK and not job.shared]
        shared = [job for job in loads if job.shared]
        if cpu:
            present = [job for job in cpu if job.block in self._slot]
            failed += [job for job in cpu if job.block not in self._slot]
            if present:
                pages = self._new_pages(len(present), device)
                slots = [self._slot[job.block] for job in present]
                for index, slot, count in slot_runs(slots):
                    pages[index : index + count].copy_(
                        self._slab[slot : slot + count], non_blocking=True
                    )
                scatter_blocks(self.cache, [job.engine_block for job in present], pages)
        failed += self._load_files(self.disk, disk)
        failed += self._load_files(self.shared, shared)
        return failed

    def layer_batch(self, loads: Sequence[LoadJob]) -> tuple[LayerBatch | None, list[LoadJob]]:
        """What ``copy_layer`` needs to load ``loads`` (CPU-tier jobs) one layer at a time, and
        the jobs whose block the slab no longer holds (failed, for vLLM to recompute)."""
        present = [job for job in loads if job.block in self._slot]
        failed = [job for job in loads if job.block not in self._slot]
        if not present:
            return None, failed
        slots = torch.tensor([self._slot[job.block] for job in present], dtype=torch.int64)
        engine_blocks = torch.tensor([job.engine_block for job in present], dtype=torch.int64)
        return LayerBatch(slots, engine_blocks.to(self.cache.layout.device)), failed

    def copy_layer(self, batch: LayerBatch, layer: int) -> None:
        """Layer ``layer`` of ``batch``'s blocks, from the slab into the engine's cache."""
        pages = self._slab[:, layer].index_select(0, batch.slots)
        scatter_layer(self.cache, layer, batch.engine_blocks, pages.to(self.cache.layout.device))

    def _load_files(self, tier: DiskTier | None, jobs: list[LoadJob]) -> list[LoadJob]:
        """Read ``jobs``' blocks from ``tier``'s files into their engine blocks; the failed."""
        if not jobs:
            return []
        if tier is None:
            return jobs
        pages = self._new_pages(len(jobs), torch.device("cpu"))
        _, ok = tier.get([job.block for job in jobs], _as_bytes(pages))
        good = [i for i, fine in enumerate(ok) if fine]
        if good:
            rows = torch.tensor(good)
            # A pageable source: the copy to the device completes before ``pages`` is freed.
            staged = pages.index_select(0, rows).to(self.cache.layout.device)
            scatter_blocks(self.cache, [jobs[i].engine_block for i in good], staged)
        return [job for job, fine in zip(jobs, ok, strict=True) if not fine]

    def prefetch(self, prefetch: Prefetch) -> list[BlockHash]:
        """Read ``prefetch``'s blocks from their files into free slab slots (the loader's
        thread); returns the blocks that failed (unreadable, or no slot free)."""
        failed: list[BlockHash] = []
        for tier, shared in ((self.disk, False), (self.shared, True)):
            pairs = zip(prefetch.blocks, prefetch.shared, strict=True)
            blocks = [block for block, from_shared in pairs if from_shared == shared]
            if not blocks:
                continue
            if tier is None:
                failed += blocks
                continue
            pages = self._new_pages(len(blocks), torch.device("cpu"))
            _, ok = tier.get(blocks, _as_bytes(pages))
            taken: list[tuple[int, BlockHash, int]] = []
            with self._slots_lock:  # held briefly: the step's thread stores under it
                for row, (block, fine) in enumerate(zip(blocks, ok, strict=True)):
                    if block in self._slot:
                        continue
                    if fine and self._free:
                        taken.append((row, block, self._free.pop()))
                    else:
                        failed.append(block)
            for row, _, slot in taken:  # slots no one else can see yet
                self._slab[slot].copy_(pages[row])
            with self._slots_lock:
                self._slot.update((block, slot) for _, block, slot in taken)
        return failed

    def _new_pages(self, count: int, device: torch.device) -> torch.Tensor:
        return torch.empty((count, *self._page_shape), dtype=self._slab.dtype, device=device)

    # ---- after the forward pass ----------------------------------------------------------------

    def run(self, jobs: Sequence[Job]) -> None:
        """Moves, drops and stores in plan order; consecutive stores to one tier share one
        gather, and the step's shared-folder writes one more."""
        self._share([job for job in jobs if isinstance(job, ShareJob)])
        stores: list[StoreJob] = []
        for job in jobs:
            if isinstance(job, ShareJob):
                continue
            if isinstance(job, StoreJob) and (not stores or stores[0].tier is job.tier):
                stores.append(job)
                continue
            self._store(stores)
            stores = []
            if isinstance(job, StoreJob):
                stores.append(job)
            elif isinstance(job, MoveJob):
                self._move(job.block)
            elif isinstance(job, DropJob):
                self._drop(job)
        self._store(stores)

    def _share(self, shares: list[ShareJob]) -> None:
        if shares and self.shared is not None:
            staged = gather_blocks(self.cache, [job.engine_block for job in shares])
            self.shared.put([job.block for job in shares], _as_bytes(staged.to("cpu")))

    def _store(self, stores: list[StoreJob]) -> None:
        if not stores:
            return
        if stores[0].tier is Tier.DISK:
            if self.disk is not None:
                staged = gather_blocks(self.cache, [job.engine_block for job in stores])
                self.disk.put([job.block for job in stores], _as_bytes(staged.to("cpu")))
            return
        with self._slots_lock:
            fresh = [job for job in stores if job.block not in self._slot]
            if len(fresh) > len(self._free):
                logger.error("CPU tier out of slots (%d free for %d)", len(self._free), len(fresh))
                fresh = fresh[: len(self._free)]
            # Which block gets which free slot is arbitrary: ascending slots make long runs.
            slots = sorted(self._free.pop() for _ in fresh)
            for job, slot in zip(fresh, slots, strict=True):
                self._slot[job.block] = slot
        if not fresh:
            return
        staged = gather_blocks(self.cache, [job.engine_block for job in fresh])
        for index, slot, count in slot_runs(slots):
            self._slab[slot : slot + count].copy_(staged[index : index + count], non_blocking=True)
        if staged.is_cuda:
            self._stores_done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's
            self._stores_done.record()

    def _move(self, block: BlockHash) -> None:
        with self._slots_lock:
            slot = self._slot.pop(block, None)
        if slot is None:
            return
        if self.disk is not None:
            if self._stores_done is not None:  # the page may still be on its way from the GPU
                self._stores_done.synchronize()
                self._stores_done = None
            # DiskTier copies the page before it returns, so the slot can be reused at once.
            self.disk.put([block], _as_bytes(self._slab[slot : slot + 1]))
        with self._slots_lock:
            self._free.append(slot)

    def _drop(self, job: DropJob) -> None:
        if job.tier is Tier.CPU:
            with self._slots_lock:
                slot = self._slot.pop(job.block, None)
                if slot is not None:
                    self._free.append(slot)
        elif self.disk is not None:
            self.disk.remove([job.block])

    def close(self) -> None:
        for tier in (self.disk, self.shared):
            if tier is not None:
                tier.close()


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first slot, count)`` for each run of consecutive ascending slots."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((position, slot, 1))
    return runs


def _as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` pages as ``[n, page_bytes]`` uint8 (a view: no copy)."""
    return pages.view(torch.uint8).reshape(pages.shape[0], -1)
