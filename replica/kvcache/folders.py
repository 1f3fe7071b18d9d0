"""Where the disk tiers keep their files, torch-free (the replica's process lists the shared
tier's folder without loading the tensor stack): one folder per cache fingerprint and rank, one
``<block hash>.kv`` file per block."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


def cache_folder(root: str, hasher: BlockHasher) -> Path:
    """``root``'s sub-folder for one cache fingerprint (model, block size, hashing): blocks of
    different ones never mix. The fingerprint's digest is its name."""
    digest = hashlib.blake2b(hasher.fingerprint.to_json().encode(), digest_size=8).hexdigest()
    return Path(os.path.expanduser(root)) / digest


def rank_folder(folder: Path, rank: int) -> Path:
    """One tensor-parallel rank's files (each rank keeps its shard of every block)."""
    return folder / f"rank{rank}"


def measure_read_rate(folder: Path, nbytes: int = 32 * 2**20) -> float:
    """Bytes/s of reading one large file back from ``folder``, best of three (the page cache
    may serve it: an upper bound of what a tier there reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(nbytes)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".probe") as probe:
        probe.write(payload)
        probe.flush()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            with open(probe.name, "rb") as f:
                while f.read(8 * 2**20):
                    pass
            best = min(best, time.perf_counter() - start)
    return nbytes / best


def block_path(directory: Path, block: BlockHash) -> Path:
    return directory / f"{block:016x}{SUFFIX}"


@dataclass(frozen=True, slots=True)
class DiskEntry:
    block: BlockHash
    mtime: float


def list_entries(directory: Path) -> list[DiskEntry]:
    """The block files in ``directory`` by name and mtime, unread and untouched (a folder that
    other processes write: their temporary files and headers are theirs). Missing -> []."""
    found: list[DiskEntry] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    block = BlockHash(int(entry.name[: -len(SUFFIX)], 16))
                    found.append(DiskEntry(block, entry.stat().st_mtime))
                except (OSError, ValueError):  # deleted since the listing, or not ours
                    continue
    except FileNotFoundError:
        return []
    return found
