"""The disk tier: bit-exact round trips, misses for every kind of bad file, queued writes served
from memory, removal ordering, the start-up scan and write errors."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache import disk
from prefixmesh.replica.kvcache.disk import DiskTier, scan
from prefixmesh.replica.kvcache.folders import DiskEntry, block_path

PAGE = 64
TAG = "layers=2,page=64,uint8"


def pages(n: int, seed: int = 0, page_bytes: int = PAGE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=gen)


def h(*blocks: int) -> list[BlockHash]:
    return [BlockHash(b) for b in blocks]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    t = DiskTier(tmp_path / "kv", TAG, PAGE)
    yield t
    t.close()


@dataclass
class Gate:
    """Holds the writer thread inside ``os.replace``: the temporary file is written, the final
    one not yet."""

    entered: threading.Event
    release: threading.Event


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(threading.Event(), threading.Event())
    real = os.replace

    def gated(src: str | Path, dst: str | Path) -> None:
        g.entered.set()
        g.release.wait(5.0)
        real(src, dst)

    monkeypatch.setattr(disk.os, "replace", gated)
    yield g
    g.release.set()


def test_block_path_is_the_zero_padded_hex_hash(tmp_path: Path) -> None:
    assert block_path(tmp_path, BlockHash(0xAB)) == tmp_path / "00000000000000ab.kv"
    assert block_path(tmp_path, BlockHash(2**64 - 1)) == tmp_path / "ffffffffffffffff.kv"


def test_round_trip_is_bit_exact(tier: DiskTier) -> None:
    blocks = h(1, 2**64 - 1, 0x1234)
    data = pages(3)
    tier.put(blocks, data)
    data.zero_()  # the tier copied the pages: the caller may reuse its buffer
    assert tier.flush()
    assert sorted(p.name for p in tier.directory.iterdir()) == [
        "0000000000000001.kv",
        "0000000000001234.kv",
        "ffffffffffffffff.kv",
    ]
    out, ok = tier.get(list(reversed(blocks)))
    assert ok == [True, True, True]
    assert torch.equal(out, pages(3).flip(0))
    dest = torch.zeros((2, PAGE), dtype=torch.uint8)
    got, ok = tier.get(h(0x1234, 1), dest)
    assert got is dest
    assert ok == [True, True]
    assert torch.equal(dest, pages(3)[[2, 0]])
    assert tier.write_errors == 0


def test_a_missing_block_is_a_miss_and_its_row_is_untouched(tier: DiskTier) -> None:
    tier.put(h(1), pages(1))
    assert tier.flush()
    dest = torch.full((3, PAGE), 7, dtype=torch.uint8)
    _, ok = tier.get(h(5, 1, 6), dest)
    assert ok == [False, True, False]
    assert torch.equal(dest[0], torch.full((PAGE,), 7, dtype=torch.uint8))
    assert torch.equal(dest[1], pages(1)[0])
    assert torch.equal(dest[2], torch.full((PAGE,), 7, dtype=torch.uint8))
    assert tier.get([])[1] == []


def test_a_write_in_flight_is_served_from_memory(tier: DiskTier, gate: Gate) -> None:
    path = block_path(tier.directory, BlockHash(1))
    path.write_bytes(b"PMKV torn")  # an old torn file must not be read meanwhile
    tier.put(h(1, 2), pages(2, seed=1))
    assert gate.entered.wait(5.0)
    assert [p.name for p in tier.directory.glob("0000000000000001.kv.*.tmp")]
    assert not tier.flush(timeout_s=0.01)
    tier.put(h(2), pages(1, seed=2))  # queued behind the job in flight: the newer page wins
    out, ok = tier.get(h(1, 2))
    assert ok == [True, True]
    assert torch.equal(out[0], pages(2, seed=1)[0])
    assert torch.equal(out[1], pages(1, seed=2)[0])
    assert path.read_bytes() == b"PMKV torn"
    gate.release.set()
    assert tier.flush()
    out, ok = tier.get(h(1, 2))
    assert ok == [True, True]
    assert torch.equal(out, torch.stack([pages(2, seed=1)[0], pages(1, seed=2)[0]]))
    assert sorted(p.name for p in tier.directory.iterdir()) == [
        "0000000000000001.kv",
        "0000000000000002.kv",
    ]


def test_a_queued_remove_wins_over_the_earlier_write(tier: DiskTier, gate: Gate) -> None:
    tier.put(h(1), pages(1))
    assert gate.entered.wait(5.0)
    tier.remove(h(1))
    assert tier.get(h(1))[1] == [False]  # the removal is queued: already a miss
    gate.release.set()
    assert tier.flush()
    assert tier.get(h(1))[1] == [False]
    assert list(tier.directory.iterdir()) == []


def test_remove_after_put_leaves_no_file(tier: DiskTier) -> None:
    tier.put(h(1, 2), pages(2))
    tier.remove(h(1, 3))  # 3 was never written: nothing to do
    assert tier.flush()
    assert [p.name for p in tier.directory.iterdir()] == ["0000000000000002.kv"]
    assert tier.get(h(1, 2))[1] == [False, True]
    tier.put(h(1), pages(1, seed=4))  # written again after the removal
    assert tier.flush()
    out, ok = tier.get(h(1))
    assert ok == [True]
    assert torch.equal(out, pages(1, seed=4))


def test_a_truncated_file_is_a_miss_and_is_deleted(tier: DiskTier) -> None:
    tier.put(h(1, 2), pages(2))
    assert tier.flush()
    one, two = block_path(tier.directory, BlockHash(1)), block_path(tier.directory, BlockHash(2))
    os.truncate(one, one.stat().st_size - 1)  # cut the payload
    os.truncate(two, 10)  # cut the header
    dest = torch.full((2, PAGE), 7, dtype=torch.uint8)
    _, ok = tier.get(h(1, 2), dest)
    assert ok == [False, False]
    assert torch.equal(dest, torch.full((2, PAGE), 7, dtype=torch.uint8))
    assert not one.exists()
    assert not two.exists()


def test_a_flipped_payload_byte_fails_the_checksum(tier: DiskTier) -> None:
    tier.put(h(1), pages(1))
    assert tier.flush()
    path = block_path(tier.directory, BlockHash(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    assert tier.get(h(1))[1] == [False]
    assert not path.exists()


@pytest.mark.parametrize(("tag", "page_bytes"), [("other-layout", PAGE), (TAG, PAGE // 2)])
def test_a_file_of_another_layout_or_page_size_is_a_miss(
    tier: DiskTier, tag: str, page_bytes: int
) -> None:
    other = DiskTier(tier.directory, tag, page_bytes)
    other.put(h(1), pages(1, page_bytes=page_bytes))
    other.close()
    assert block_path(tier.directory, BlockHash(1)).exists()
    assert tier.get(h(1))[1] == [False]
    assert list(tier.directory.iterdir()) == []


def test_a_file_renamed_to_another_blocks_name_is_a_miss(tier: DiskTier) -> None:
    tier.put(h(1), pages(1))
    assert tier.flush()
    os.rename(block_path(tier.directory, BlockHash(1)), block_path(tier.directory, BlockHash(2)))
    assert tier.get(h(2, 1))[1] == [False, False]
    assert list(tier.directory.iterdir()) == []


def test_scan_restores_the_index_oldest_first_and_cleans_up(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    assert scan(directory, TAG, PAGE) == []
    first = DiskTier(directory, TAG, PAGE)
    first.put(h(1, 2, 3), pages(3))
    first.close()
    for block, mtime in [(1, 3000.0), (2, 1000.0), (3, 2000.0)]:
        os.utime(block_path(directory, BlockHash(block)), (mtime, mtime))
    other = DiskTier(directory, "other-layout", PAGE)
    other.put(h(4), pages(1))
    other.close()
    (directory / "0000000000000005.kv.tmp").write_bytes(b"torn write")
    (directory / "0000000000000006.kv").write_bytes(b"XXXX" + bytes(100))
    (directory / "not-hex.kv").write_bytes(b"")
    (directory / "notes.txt").write_text("not ours")

    found = scan(directory, TAG, PAGE)
    assert found == [
        DiskEntry(BlockHash(2), 1000.0),
        DiskEntry(BlockHash(3), 2000.0),
        DiskEntry(BlockHash(1), 3000.0),
    ]
    assert sorted(p.name for p in directory.iterdir()) == [
        "0000000000000001.kv",
        "0000000000000002.kv",
        "0000000000000003.kv",
        "notes.txt",
    ]
    second = DiskTier(directory, TAG, PAGE)
    out, ok = second.get([entry.block for entry in found])
    second.close()
    assert ok == [True, True, True]
    assert torch.equal(out, pages(3)[[1, 2, 0]])


def test_put_and_get_validate_the_pages(tier: DiskTier) -> None:
    with pytest.raises(ValueError, match=r"uint8 CPU tensor of shape \[2, 64\]"):
        tier.put(h(1, 2), pages(1))
    with pytest.raises(ValueError, match=r"torch\.int32"):
        tier.put(h(1), torch.zeros((1, PAGE), dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        tier.put(h(1), torch.zeros((1, PAGE + 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="meta"):
        tier.put(h(1), torch.empty((1, PAGE), dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        tier.put(h(2**64), pages(1))
    with pytest.raises(ValueError, match="out must be"):
        tier.get(h(1), torch.zeros((2, PAGE), dtype=torch.uint8))
    assert tier.flush()
    assert list(tier.directory.iterdir()) == []


def test_a_write_error_is_counted_not_raised(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(src: str | Path, dst: str | Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", full)
    tier.put(h(1, 2), pages(2))
    assert tier.flush()
    assert tier.write_errors == 2
    assert "No space left on device" in caplog.text
    assert list(tier.directory.iterdir()) == []  # no .tmp left behind
    assert tier.get(h(1, 2))[1] == [False, False]
    monkeypatch.undo()
    tier.put(h(1), pages(1))
    assert tier.flush()
    assert tier.get(h(1))[1] == [True]
    assert tier.write_errors == 2


def test_close_flushes_and_is_idempotent(tmp_path: Path) -> None:
    t = DiskTier(tmp_path / "kv", TAG, PAGE)
    t.put(h(1), pages(1))
    t.close()
    assert block_path(tmp_path / "kv", BlockHash(1)).exists()
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.put(h(2), pages(1))
    assert t.get(h(1))[1] == [True]  # reads still work after close


def test_two_writers_of_one_block_each_rename_a_whole_file_of_their_own(
    tmp_path: Path, gate: Gate
) -> None:
    """A shared folder: the temporary names differ per writer, so one writer's rename never
    moves the other's half-written file (the old fixed ``.kv.tmp`` name let them interleave)."""
    first = DiskTier(tmp_path / "shared", TAG, PAGE)
    second = DiskTier(tmp_path / "shared", TAG, PAGE)
    try:
        first.put(h(1), pages(1, seed=1))
        assert gate.entered.wait(5.0)  # first's file is written, its rename held
        gate.entered.clear()
        second.put(h(1), pages(1, seed=2))
        assert gate.entered.wait(5.0)
        temporaries = sorted(p.name for p in first.directory.glob("*.tmp"))
        assert len(temporaries) == 2, temporaries
        gate.release.set()
        assert first.flush() and second.flush()
        reader = DiskTier(tmp_path / "shared", TAG, PAGE)
        out, ok = reader.get(h(1))
        reader.close()
        assert ok == [True]
        assert torch.equal(out[0], pages(1, seed=1)[0]) or torch.equal(out[0], pages(1, seed=2)[0])
        assert not list(first.directory.glob("*.tmp"))
    finally:
        gate.release.set()
        first.close()
        second.close()


def test_write_once_keeps_the_first_file_and_reads_mark_it_used(tmp_path: Path) -> None:
    shared = DiskTier(tmp_path / "shared", TAG, PAGE, write_once=True, touch_on_read=True)
    try:
        shared.put(h(1), pages(1, seed=1))
        assert shared.flush()
        path = block_path(shared.directory, BlockHash(1))
        os.utime(path, (1_000, 1_000))
        shared.put(h(1), pages(1, seed=2))  # stored already (by this or another replica)
        assert shared.flush()
        assert os.stat(path).st_mtime == 1_000  # not rewritten
        out, ok = shared.get(h(1))
        assert ok == [True] and torch.equal(out[0], pages(1, seed=1)[0])
        assert os.stat(path).st_mtime > 1_000  # used now: the last to be evicted
    finally:
        shared.close()
