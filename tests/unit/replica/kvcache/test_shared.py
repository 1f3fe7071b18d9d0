"""The shared tier's index: what a folder other processes write holds, and one eviction order
for all of them (least recently used first, ties by block)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import torch

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.disk import DiskTier
from prefixmesh.replica.kvcache.folders import DiskEntry, block_path
from prefixmesh.replica.kvcache.shared import EVICTION_LOCK, SharedDirIndex, shared_victims

PAGE = 64
TAG = "shared-test"


def write(directory: Path, *blocks: int) -> None:
    tier = DiskTier(directory, TAG, PAGE, write_once=True)
    tier.put([BlockHash(b) for b in blocks], torch.zeros((len(blocks), PAGE), dtype=torch.uint8))
    tier.close()


def test_victims_are_the_least_recently_used_beyond_the_capacity() -> None:
    entries = [DiskEntry(BlockHash(b), mtime) for b, mtime in [(1, 5.0), (2, 1.0), (3, 1.0)]]
    assert shared_victims(entries, 3) == []
    assert shared_victims(entries, 1) == [2, 3]  # oldest first, ties by block
    assert shared_victims(entries, 0) == [2, 3, 1]


def test_the_index_lists_blocks_ignores_other_files_and_evicts_to_capacity(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "shared"
    write(folder, 1, 2, 3)
    (folder / "0000000000000009.kv.123-4.tmp").write_bytes(b"another writer, mid-write")
    (folder / "notes.txt").write_text("not ours")
    for block, mtime in [(1, 3_000), (2, 1_000), (3, 2_000)]:
        os.utime(block_path(folder, BlockHash(block)), (mtime, mtime))
    index = SharedDirIndex(folder, capacity_blocks=2, scan_interval_s=60)
    assert index.refresh() == {1, 3}
    assert not block_path(folder, BlockHash(2)).exists()
    assert (folder / "0000000000000009.kv.123-4.tmp").exists()  # never another writer's file
    assert index.evicted == 1 and index.blocks == {1, 3}


def test_while_another_replica_evicts_this_one_leaves_the_files_alone(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    write(folder, 1, 2)
    index = SharedDirIndex(folder, capacity_blocks=1, scan_interval_s=60)
    with open(folder / EVICTION_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert index.refresh() == {1, 2}  # over capacity until the next scan
        fcntl.flock(lock, fcntl.LOCK_UN)
    assert len(index.refresh()) == 1


def test_an_unreadable_folder_means_no_shared_blocks(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    index = SharedDirIndex(blocker / "shared", capacity_blocks=4, scan_interval_s=60)
    assert index.refresh() == frozenset() and index.scan_errors == 1


def test_the_thread_picks_up_what_other_replicas_write(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    index = SharedDirIndex(folder, capacity_blocks=8, scan_interval_s=0.01)
    index.start()
    try:
        write(folder, 7)
        for _ in range(500):
            if index.blocks:
                break
            time.sleep(0.01)
        assert index.blocks == {7}
    finally:
        index.close()
