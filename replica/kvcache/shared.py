"""The cluster's shared tier on the scheduler side: which blocks a folder that every replica
shares holds, refreshed off the step path, and its eviction.

Every replica writes the blocks it computes into the folder once (``DiskTier`` with
``write_once``: whichever replica is first) and reads any block it finds there. The engine's
step must not touch the file system, so a thread lists the folder every ``scan_interval_s`` and
the planner asks the latest listing (``blocks``): a block written since is found a scan later,
one evicted since is a failed load, recomputed like any other.

Eviction is one policy for the whole folder, least recently used first: readers mark a file
used (its mtime, ``touch_on_read``), and past the folder's capacity the oldest files go. Any
replica's scan may evict; an exclusive lock on one file in the folder lets one at a time do it,
and a reader that already opened a deleted file reads it whole (POSIX), so eviction never makes
wrong KV, only misses.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.folders import DiskEntry, block_path, list_entries

logger = logging.getLogger(__name__)

EVICTION_LOCK = ".evict.lock"


def shared_victims(entries: Sequence[DiskEntry], capacity_blocks: int) -> list[BlockHash]:
    """The blocks to delete so that ``capacity_blocks`` remain: the least recently used
    (oldest mtime) first; ties by block, so every replica picks the same ones."""
    excess = len(entries) - max(0, capacity_blocks)
    if excess <= 0:
        return []
    ordered = sorted(entries, key=lambda entry: (entry.mtime, entry.block))
    return [entry.block for entry in ordered[:excess]]


class SharedDirIndex:
    """The shared folder's blocks as of the latest scan, and its eviction to
    ``capacity_blocks``. ``start`` runs the scans on a thread; ``refresh`` runs one now."""

    def __init__(self, directory: Path, capacity_blocks: int, scan_interval_s: float) -> None:
        self.directory = Path(directory)
        self.capacity_blocks = capacity_blocks
        self._interval_s = scan_interval_s
        self._blocks: frozenset[BlockHash] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted = 0
        """Files this index deleted to keep the folder within its capacity."""
        self.scan_errors = 0

    @property
    def blocks(self) -> frozenset[BlockHash]:
        """What the folder held at the latest scan (a snapshot: replaced, never changed)."""
        return self._blocks

    def refresh(self) -> frozenset[BlockHash]:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = list_entries(self.directory)
            victims = shared_victims(entries, self.capacity_blocks)
            if victims and self._evict(victims):
                gone = set(victims)
                entries = [entry for entry in entries if entry.block not in gone]
        except OSError as exc:  # an unreachable folder: no shared blocks, loads recompute
            self.scan_errors += 1
            logger.warning("shared KV tier %s cannot be read: %s", self.directory, exc)
            entries = []
        self._blocks = frozenset(entry.block for entry in entries)
        return self._blocks

    def _evict(self, victims: list[BlockHash]) -> bool:
        """Delete ``victims`` if no other replica is evicting now (False: one is)."""
        with open(self.directory / EVICTION_LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                for block in victims:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(block_path(self.directory, block))
                        self.evicted += 1
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return True

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="prefixmesh-shared-kv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
