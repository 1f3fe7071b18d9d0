"""The cluster's shared KV tier in the registry: one replica at a time lists the shared folder
and publishes what it holds as ``SHARED_TIER`` (the registry's one holder for the whole
cluster, in the disk tier), so routers credit every replica with those blocks.

Which replica publishes is decided by an exclusive lock on a file in the folder, held for as
long as that replica's process lives: the operating system releases it when the process dies,
and the next replica to try takes it over. A new publisher starts a new epoch whose first event
is the whole listing, so the registry forgets what the previous one said and takes this. The
listing runs on a thread (the file system is not the event loop's business); between listings
only the difference is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.engines.base import BlockChange, Residency
from prefixmesh.replica.events.publisher import EventPublisher
from prefixmesh.replica.kvcache.folders import list_entries
from prefixmesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

PUBLISHER_LOCK = ".publisher.lock"

MakePublisher = Callable[[Callable[[], Residency]], EventPublisher]
"""An ``EventPublisher`` for ``SHARED_TIER`` whose resync snapshots come from the given
residency."""


def listing_changes(before: frozenset[BlockHash], after: frozenset[BlockHash]) -> list[BlockChange]:
    """What the registry must be told to go from one listing to the next (disk tier)."""
    changes = []
    if stored := sorted(after - before):
        changes.append(BlockChange(EventKind.STORED, Tier.DISK, tuple(stored)))
    if removed := sorted(before - after):
        changes.append(BlockChange(EventKind.REMOVED, Tier.DISK, tuple(removed)))
    return changes


def list_blocks(folder: Path) -> frozenset[BlockHash]:
    return frozenset(entry.block for entry in list_entries(folder))


class FolderLock:
    """An exclusive ``flock`` on one file, tried without waiting; released by ``release`` or
    by the process's death."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def try_acquire(self) -> bool:
        if self._file is not None:
            return True
        self._path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self._path, "a")  # noqa: SIM115 (kept open: the lock lives with it)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        return True

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class SharedTierPublisher:
    def __init__(self, folder: Path, make_publisher: MakePublisher, interval_s: float) -> None:
        self.folder = folder
        self._make_publisher = make_publisher
        self._interval_s = interval_s
        self._lock = FolderLock(folder / PUBLISHER_LOCK)
        self._listing: frozenset[BlockHash] = frozenset()
        self.publisher: EventPublisher | None = None
        """This replica's publisher of ``SHARED_TIER`` while it holds the lock (else None)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # an unreadable folder: try again next time
                logger.exception("publishing the shared KV tier failed")
            await asyncio.sleep(self._interval_s)

    async def step(self) -> None:
        """Take the lock if it is free; while held, publish what changed in the folder."""
        if self.publisher is None:
            if not await asyncio.to_thread(self._lock.try_acquire):
                return
            self._listing = await asyncio.to_thread(list_blocks, self.folder)
            publisher = self._make_publisher(lambda: Residency.of({Tier.DISK: self._listing}))
            # A new epoch whose first event is the whole listing: the registry drops what an
            # earlier publisher said and keeps this.
            publisher.submit([BlockChange(EventKind.STORED, Tier.DISK, tuple(self._listing))])
            publisher.start()
            self.publisher = publisher
            logger.info("this replica publishes the shared KV tier (%d blocks)", len(self._listing))
            return
        listing = await asyncio.to_thread(list_blocks, self.folder)
        self.publisher.submit(listing_changes(self._listing, listing))
        self._listing = listing

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self.publisher is not None:
            await self.publisher.stop()
            await self.publisher.flush()
            self.publisher = None
        self._lock.release()
