"""The disk tier of a replica's KV cache: one file a block, written on a background thread.

A file is a header (magic, format version, block hash, payload length, xxhash64 of the payload,
layout tag) and then the block's page. Writes go to a ``.tmp`` file that ``os.replace`` renames
onto the final name, so a reader sees an old complete file or a new complete one; without fsync
a crash can leave a ``.tmp`` or a torn file, and either is a miss (and deleted), never wrong KV.
Blocks whose write or removal is still queued are answered from memory, so the caller never
waits for the disk on ``put`` and never reads a file its own earlier ``put`` has not finished.

Several processes may share one folder (the cluster's shared tier, ``shared.py``): each writer
names its temporary files after its process and thread, so two writers of one block each
rename a whole file of their own and the last rename wins; ``write_once`` skips a block whose
file exists already, and ``touch_on_read`` marks a file used (its mtime), which is what the
shared tier's eviction orders by.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.folders import SUFFIX as _SUFFIX
from prefixmesh.replica.kvcache.folders import TMP_SUFFIX as _TMP_SUFFIX
from prefixmesh.replica.kvcache.folders import DiskEntry, block_path

logger = logging.getLogger(__name__)

MAGIC = b"PMKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHQQQH")
"""magic, version, block hash, payload length, payload xxhash64, layout tag length (bytes)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Job:
    """One ``put`` (``pages`` is the tier's own copy, one row a block) or ``remove`` (None);
    compared by identity, so the writer can tell whether a later job superseded it."""

    blocks: tuple[BlockHash, ...]
    pages: torch.Tensor | None


def _encode_tag(layout_tag: str) -> bytes:
    tag = layout_tag.encode()
    if len(tag) > 0xFFFF:
        raise ValueError(f"layout tag is {len(tag)} bytes, at most 65535 fit the header")
    return tag


def _header_ok(header: bytes, block: BlockHash, tag: bytes, page_bytes: int) -> int | None:
    """The payload checksum when ``header`` (fixed part and tag) fits this block and layout."""
    if len(header) != _HEADER.size + len(tag):
        return None
    magic, version, found, length, checksum, tag_len = _HEADER.unpack_from(header)
    want = (MAGIC, FORMAT_VERSION, block, page_bytes, len(tag))
    fits = (magic, version, found, length, tag_len) == want
    return checksum if fits and header[_HEADER.size :] == tag else None


def _unlink_if_same(path: Path, inode: int) -> None:
    """Delete a bad file unless the writer has replaced it by a new one since it was opened."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def scan(directory: Path, layout_tag: str, page_bytes: int) -> list[DiskEntry]:
    """What a tier holds on start: every file whose header is valid for this layout tag and page
    size (cheap: reads headers and file sizes, not payloads), oldest mtime first. Deletes leftover
    temporary files from torn writes and files whose header is invalid. Missing directory -> []."""
    tag = _encode_tag(layout_tag)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found: list[DiskEntry] = []
    for name in names:
        path = directory / name
        if name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        if not name.endswith(_SUFFIX):
            continue  # not ours: leave it alone
        try:
            block = BlockHash(int(name[: -len(_SUFFIX)], 16))
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                valid = (
                    _header_ok(f.read(_HEADER.size + len(tag)), block, tag, page_bytes) is not None
                    and st.st_size == _HEADER.size + len(tag) + page_bytes
                )
        except (OSError, ValueError):
            valid, st = False, None
        if valid and st is not None:
            found.append(DiskEntry(block, st.st_mtime))
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    found.sort(key=lambda entry: (entry.mtime, entry.block))
    return found


class DiskTier:
    """Blocks as files in ``directory``; ``put`` and ``remove`` run on one writer thread, in
    the order they were called, and ``get`` on the caller's thread."""

    def __init__(
        self,
        directory: Path,
        layout_tag: str,
        page_bytes: int,
        *,
        write_once: bool = False,
        touch_on_read: bool = False,
    ) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.directory = Path(directory)
        self.layout_tag = layout_tag
        self.page_bytes = page_bytes
        self._tag = _encode_tag(layout_tag)
        self._write_once = write_once
        self._touch_on_read = touch_on_read
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[BlockHash, tuple[_Job, int]] = {}
        """The latest queued or in-flight job of each block, and the block's row in it."""
        self._outstanding = 0
        self._closed = False
        self._write_errors = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefixmesh-disk-tier", daemon=True)
        self._thread.start()

    @property
    def write_errors(self) -> int:
        """Block writes that failed (disk full, permissions): logged and counted, never raised."""
        return self._write_errors

    def put(self, blocks: Sequence[BlockHash], pages: torch.Tensor) -> None:
        """Queue the blocks' pages (uint8 ``[len(blocks), page_bytes]`` on CPU) for writing; the
        pages are copied first, so the caller may reuse its buffer at once."""
        self._check_pages("pages", pages, len(blocks))
        for block in blocks:
            if not 0 <= block < 2**64:
                raise ValueError(f"block hash {block} is not an unsigned 64-bit integer")
        if blocks:
            self._submit(_Job(tuple(blocks), pages.detach().clone()))

    def remove(self, blocks: Sequence[BlockHash]) -> None:
        """Queue the blocks' deletion, after any write of them queued earlier."""
        if blocks:
            self._submit(_Job(tuple(blocks), None))

    def get(
        self, blocks: Sequence[BlockHash], out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[bool]]:
        """Read block i into row i of ``out``; ok[i] is False for a missing, torn or corrupt file
        (deleted) or a block whose removal is queued. A row with ok False is left as it was,
        except after a checksum mismatch: the payload is read straight into the row."""
        if out is None:
            out = torch.empty((len(blocks), self.page_bytes), dtype=torch.uint8)
        self._check_pages("out", out, len(blocks))
        ok = [False] * len(blocks)
        for i, block in enumerate(blocks):
            with self._lock:
                pending = self._pending.get(block)
            if pending is None:
                ok[i] = self._read(block, out[i])
            elif (page := pending[0].pages) is not None:
                out[i].copy_(page[pending[1]])
                ok[i] = True
        return out, ok

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and removal is done; False if ``timeout_s`` ran out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout=timeout_s)

    def close(self) -> None:
        """Flush, then stop the writer thread; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._jobs.put(None)
        self._thread.join(timeout=10.0)

    # ---- internals --------------------------------------------------------------------------

    def _check_pages(self, name: str, pages: torch.Tensor, n: int) -> None:
        want = (n, self.page_bytes)
        if not isinstance(pages, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dtype != torch.uint8 or pages.device.type != "cpu" or tuple(pages.shape) != want:
            raise ValueError(
                f"{name} must be a uint8 CPU tensor of shape {list(want)}, got "
                f"{pages.dtype} on {pages.device} of shape {list(pages.shape)}"
            )

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("DiskTier is closed")
            for row, block in enumerate(job.blocks):
                self._pending[block] = (job, row)
            self._outstanding += 1
            self._jobs.put(job)  # under the lock: queue order is pending order

    def _read(self, block: BlockHash, row: torch.Tensor) -> bool:
        path = block_path(self.directory, block)
        inode: int | None = None
        fine = False
        with contextlib.suppress(OSError), open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            inode = st.st_ino
            fine = self._read_file(f, st.st_size, block, row)
        if not fine and inode is not None:
            _unlink_if_same(path, inode)
        elif fine and self._touch_on_read:
            with contextlib.suppress(OSError):  # evicted meanwhile: the read was whole
                os.utime(path)
        return fine

    def _read_file(self, f: io.FileIO, size: int, block: BlockHash, row: torch.Tensor) -> bool:
        """Header, size and checksum checks; the payload goes straight into ``row``."""
        header = f.read(_HEADER.size + len(self._tag))
        checksum = _header_ok(header, block, self._tag, self.page_bytes)
        if checksum is None or size != len(header) + self.page_bytes:
            return False
        dest = row.numpy()
        view = dest.data if dest.flags.c_contiguous else bytearray(dest.size)
        if f.readinto(view) != self.page_bytes or xxhash.xxh64_intdigest(view) != checksum:
            return False
        if not isinstance(view, memoryview):  # a strided row: one more copy
            row.copy_(torch.frombuffer(view, dtype=torch.uint8))
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._do(job)
            except Exception:
                logger.exception("disk tier: job for %d blocks failed", len(job.blocks))
            finally:
                with self._lock:
                    for row, block in enumerate(job.blocks):
                        if self._pending.get(block) == (job, row):
                            del self._pending[block]
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _do(self, job: _Job) -> None:
        for row, block in enumerate(job.blocks):
            with self._lock:
                if self._pending.get(block) != (job, row):
                    continue  # a later put or remove of this block supersedes this one
            path = block_path(self.directory, block)
            if job.pages is None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("disk tier: cannot remove %s: %s", path, e)
                continue
            if self._write_once and path.exists():
                continue  # another writer of the shared folder stored it first
            try:
                self._write(path, block, job.pages[row].numpy())
            except OSError as e:
                self._write_errors += 1
                logger.warning("disk tier: cannot write %s: %s", path, e)

    def _write(self, path: Path, block: BlockHash, page: npt.NDArray[np.uint8]) -> None:
        # Named after this writer: another process writing the same block never shares it.
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_native_id()}{_TMP_SUFFIX}")
        checksum = xxhash.xxh64_intdigest(page.data)
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, block, page.size, checksum, len(self._tag))
        try:
            with open(tmp, "wb") as f:
                f.write(header + self._tag)
                f.write(page.data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
