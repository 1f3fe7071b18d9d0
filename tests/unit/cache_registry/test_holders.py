from __future__ import annotations

from prefixmesh.cache_registry.holders import (
    ReplicaIndex,
    RunSegment,
    bits_of,
    count_segments,
    iter_bits,
)
from prefixmesh.cache_registry.types import ReplicaId


def test_bits() -> None:
    assert list(iter_bits(0b1011)) == [0, 1, 3]
    assert bits_of(0) == ()
    assert bits_of(1 << 70 | 1) == (0, 70)


def test_indices_are_reused_only_after_release() -> None:
    index = ReplicaIndex()
    a, b, c = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
    assert [index.assign(a), index.assign(b), index.assign(a)] == [0, 1, 0]
    index.release(a)
    assert index.assign(c) == 0
    assert index.mask_of({b, c, ReplicaId("unknown")}) == 0b11
    assert index.id_of == {0: c, 1: b}


def test_single_segment_counts() -> None:
    rows = count_segments([RunSegment(gpu=0b11, cpu=0b100, disk=0, speculative=0b1000, length=5)])
    assert rows == {0: (5, 0, 0, 0), 1: (5, 0, 0, 0), 2: (0, 5, 0, 0), 3: (5, 0, 0, 5)}


def test_segments_add_up_per_replica() -> None:
    rows = count_segments(
        [
            RunSegment(gpu=0b111, cpu=0, disk=0, speculative=0, length=2),
            RunSegment(gpu=0b001, cpu=0b010, disk=0, speculative=0b100, length=3),
            RunSegment(gpu=0, cpu=0, disk=0b010, speculative=0, length=1),
        ]
    )
    assert rows == {0: (5, 0, 0, 0), 1: (2, 3, 1, 0), 2: (5, 0, 0, 3)}
