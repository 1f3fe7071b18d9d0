"""The connector's worker side on real tensors: blocks stored, moved to disk and loaded back
into other engine blocks are bit for bit what the engine computed. On CPU always, and on CUDA
(pinned slab, asynchronous copies, the Triton kernels) when a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.kernels.ops import PagedKVCache
from prefixmesh.replica.kvcache.disk import DiskTier
from prefixmesh.replica.kvcache.folders import block_path
from prefixmesh.replica.kvcache.plan import DropJob, LoadJob, MoveJob, Prefetch, ShareJob, StoreJob
from prefixmesh.replica.kvcache.store import TierStore, slot_runs

B = BlockHash
LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 12, 2, 16, 8
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=CUDA)])
def engine(request: pytest.FixtureRequest) -> list[torch.Tensor]:
    """vLLM 0.32's per-layer ``[num_blocks, H, N, C]`` views, random bf16 content."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(BLOCKS, HEADS, TOKENS, DIM, generator=gen).to(torch.bfloat16).to(request.param)
        for _ in range(LAYERS)
    ]


def test_slot_runs_group_consecutive_ascending_slots() -> None:
    assert slot_runs([]) == []
    assert slot_runs([4, 5, 6, 2, 3, 9, 8]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1), (6, 8, 1)]


def store(engine: list[torch.Tensor], tmp_path: Path, cpu_blocks: int) -> TierStore:
    cache = PagedKVCache.of(engine)
    page_bytes = cache.layout.page_bytes * LAYERS
    return TierStore(cache, cpu_blocks, DiskTier(tmp_path, "test-layout", page_bytes))


def block(engine: list[torch.Tensor], engine_block: int) -> list[torch.Tensor]:
    return [layer[engine_block].clone() for layer in engine]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_a_stored_block_loads_back_bit_exact_into_another_engine_block(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=4)
    originals = {i: block(engine, i) for i in (1, 2, 3)}
    s.run([StoreJob(B(10), 1), StoreJob(B(20), 2), StoreJob(B(30), 3)])
    assert s.cpu_blocks == 3
    for layer in engine:  # the engine reuses those blocks for other prompts
        layer[1:4].zero_()
    failed = s.load([LoadJob(B(30), Tier.CPU, 7), LoadJob(B(10), Tier.CPU, 8)])
    assert failed == []
    assert_same(block(engine, 7), originals[3])
    assert_same(block(engine, 8), originals[1])
    s.close()


def test_a_load_copied_layer_by_layer_is_bit_exact_and_names_missing_blocks(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=4)
    originals = {i: block(engine, i) for i in (1, 2)}
    s.run([StoreJob(B(10), 1), StoreJob(B(20), 2)])
    for layer in engine:
        layer[1:3].zero_()
    jobs = [LoadJob(B(20), Tier.CPU, 7), LoadJob(B(99), Tier.CPU, 9), LoadJob(B(10), Tier.CPU, 8)]
    batch, failed = s.layer_batch(jobs)
    assert failed == [jobs[1]] and batch is not None
    untouched = block(engine, 7)
    s.copy_layer(batch, 0)
    assert torch.equal(engine[0][7], originals[2][0])
    assert torch.equal(engine[1][7], untouched[1])  # the next layers wait for their own copy
    for layer in range(1, LAYERS):
        s.copy_layer(batch, layer)
    assert_same(block(engine, 7), originals[2])
    assert_same(block(engine, 8), originals[1])
    assert s.layer_batch([jobs[1]]) == (None, [jobs[1]])
    s.close()


def test_blocks_moved_to_disk_or_stored_there_load_back_bit_exact(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=1)
    originals = {i: block(engine, i) for i in (0, 5)}
    # 0 goes to CPU, then down to disk, its slot reused by 5; 5's next copy goes straight down.
    s.run([StoreJob(B(1), 0)])
    s.run([MoveJob(B(1)), StoreJob(B(2), 5), StoreJob(B(3), 5, Tier.DISK)])
    assert s.disk is not None and s.disk.flush()
    assert block_path(tmp_path, B(1)).exists() and block_path(tmp_path, B(3)).exists()
    for layer in engine:
        layer.zero_()
    failed = s.load(
        [LoadJob(B(1), Tier.DISK, 9), LoadJob(B(2), Tier.CPU, 10), LoadJob(B(3), Tier.DISK, 11)]
    )
    assert failed == []
    assert_same(block(engine, 9), originals[0])
    assert_same(block(engine, 10), originals[5])
    assert_same(block(engine, 11), originals[5])
    s.close()


def test_a_corrupt_or_missing_block_is_reported_and_leaves_the_engine_block_alone(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=1)
    s.run([StoreJob(B(1), 0, Tier.DISK), StoreJob(B(2), 1, Tier.DISK)])
    assert s.disk is not None and s.disk.flush()
    path = block_path(tmp_path, B(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    before = block(engine, 6)
    jobs = [
        LoadJob(B(1), Tier.DISK, 6),
        LoadJob(B(2), Tier.DISK, 7),
        LoadJob(B(99), Tier.CPU, 8),
    ]
    failed = s.load(jobs)
    assert failed == [jobs[2], jobs[0]]  # CPU misses first, then the disk's
    assert_same(block(engine, 6), before)
    assert_same(block(engine, 7), block(engine, 1))
    s.close()


def test_drops_free_cpu_slots_and_delete_disk_files(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=1)
    s.run([StoreJob(B(1), 0), StoreJob(B(2), 1, Tier.DISK)])
    s.run([DropJob(B(1), Tier.CPU), DropJob(B(2), Tier.DISK), StoreJob(B(3), 2)])
    assert s.disk is not None and s.disk.flush()
    assert s.cpu_blocks == 1 and s.holds(Tier.CPU, B(3)) and not s.holds(Tier.CPU, B(1))
    assert not block_path(tmp_path, B(2)).exists()
    s.close()


def test_many_blocks_round_trip_through_a_fragmented_slab(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    # Slots freed out of order come back as several runs; each block still lands in its own.
    s = store(engine, tmp_path, cpu_blocks=8)
    originals = {i: block(engine, i) for i in range(8)}
    s.run([StoreJob(B(100 + i), i) for i in range(8)])
    s.run([DropJob(B(101), Tier.CPU), DropJob(B(106), Tier.CPU), DropJob(B(103), Tier.CPU)])
    s.run([StoreJob(B(200), 9), StoreJob(B(201), 10), StoreJob(B(202), 11)])
    kept = [0, 2, 4, 5, 7]
    for layer in engine:
        layer[:8].zero_()
    failed = s.load([LoadJob(B(100 + i), Tier.CPU, i) for i in kept])
    assert failed == []
    for i in kept:
        assert_same(block(engine, i), originals[i])
    loaded = s.load([LoadJob(B(200 + i), Tier.CPU, 1 + i) for i in range(3)])
    assert loaded == []
    for i in range(3):
        assert_same(block(engine, 1 + i), block(engine, 9 + i))
    s.close()


def test_a_move_to_disk_right_after_a_store_writes_the_stored_page(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    # On CUDA the slab write is asynchronous: the move must wait for it, not write stale bytes.
    s = store(engine, tmp_path, cpu_blocks=2)
    original = block(engine, 4)
    s.run([StoreJob(B(7), 4), MoveJob(B(7))])
    assert s.disk is not None and s.disk.flush()
    for layer in engine:
        layer.zero_()
    assert s.load([LoadJob(B(7), Tier.DISK, 0)]) == []
    assert_same(block(engine, 0), original)
    s.close()


def test_a_block_one_replica_shares_loads_bit_exact_into_another_replica(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    """Two replicas' stores on one shared folder: what the first computed and shared, the
    second (its engine holding other content) loads into its own engine block exactly."""
    cache = PagedKVCache.of(engine)
    page_bytes = cache.layout.page_bytes * LAYERS
    folder = tmp_path / "shared"

    def shared_tier() -> DiskTier:
        return DiskTier(folder, "test-layout", page_bytes, write_once=True, touch_on_read=True)

    computer = TierStore(cache, 0, None, shared_tier())
    original = block(engine, 2)
    computer.run([ShareJob(B(42), 2)])
    computer.close()  # flushes the write
    assert block_path(folder, B(42)).exists()
    other = [torch.zeros_like(layer) for layer in engine]
    reader = TierStore(PagedKVCache.of(other), 0, None, shared_tier())
    missing = LoadJob(B(43), Tier.DISK, 6, shared=True)
    failed = reader.load([LoadJob(B(42), Tier.DISK, 5, shared=True), missing])
    assert failed == [missing]
    assert_same(block(other, 5), original)
    reader.close()


def test_a_promotion_reads_disk_blocks_into_free_slots_bit_exact_and_names_the_torn(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=2)
    originals = {i: block(engine, i) for i in (1, 2)}
    s.run(
        [StoreJob(B(1), 1, Tier.DISK), StoreJob(B(2), 2, Tier.DISK), StoreJob(B(3), 3, Tier.DISK)]
    )
    assert s.disk is not None and s.disk.flush()
    path = block_path(tmp_path, B(3))
    path.write_bytes(path.read_bytes()[:-7])  # torn
    # 4 is in no file; the shared folder is not there: both fail, and take no slot.
    failed = s.prefetch(Prefetch(0, (B(1), B(3), B(4), B(2)), (False, False, False, False)))
    assert sorted(failed) == [B(3), B(4)]
    assert s.holds(Tier.CPU, B(1)) and s.holds(Tier.CPU, B(2)) and s.cpu_blocks == 2
    assert s.prefetch(Prefetch(1, (B(9),), (True,))) == [B(9)]
    for layer in engine:
        layer.zero_()
    assert s.load([LoadJob(B(1), Tier.CPU, 7), LoadJob(B(2), Tier.CPU, 8)]) == []
    assert_same(block(engine, 7), originals[1])
    assert_same(block(engine, 8), originals[2])
    s.close()


def test_a_promotion_with_no_free_slot_fails_and_a_held_block_keeps_its_slot(
    engine: list[torch.Tensor], tmp_path: Path
) -> None:
    s = store(engine, tmp_path, cpu_blocks=1)
    s.run([StoreJob(B(1), 1, Tier.DISK), StoreJob(B(2), 2)])
    assert s.disk is not None and s.disk.flush()
    assert s.prefetch(Prefetch(0, (B(1),), (False,))) == [B(1)]  # the slab is full
    assert not s.holds(Tier.CPU, B(1))
    s.run([StoreJob(B(1), 1, Tier.DISK), DropJob(B(2), Tier.CPU)])
    assert s.disk.flush()
    assert s.prefetch(Prefetch(1, (B(1),), (False,))) == []
    assert s.prefetch(Prefetch(2, (B(1),), (False,))) == []  # held already: no second slot
    assert s.cpu_blocks == 1
    s.close()
