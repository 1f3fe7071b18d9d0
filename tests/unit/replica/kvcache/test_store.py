"""The connector's worker side on real tensors: blocks stored, moved to disk and loaded back
into other engine blocks are bit for bit what the engine computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.kernels.ops import PagedKVCache
from prefixmesh.replica.kvcache.disk import DiskTier, block_path
from prefixmesh.replica.kvcache.planner import DropJob, LoadJob, MoveJob, StoreJob
from prefixmesh.replica.kvcache.store import TierStore

B = BlockHash
LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 12, 2, 16, 8


@pytest.fixture
def engine() -> list[torch.Tensor]:
    """vLLM 0.32's per-layer ``[num_blocks, H, N, C]`` views, random bf16 content."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(BLOCKS, HEADS, TOKENS, DIM, generator=gen).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


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
