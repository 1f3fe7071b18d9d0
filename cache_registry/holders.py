"""Holder sets as integer bitmasks over small replica indices, and the run-length chain walk.

A lookup over 64 replicas x 64 blocks touches 4,096 (replica, block) pairs; as Python objects
that costs milliseconds. With one bit per replica, a block's holders in a tier are one int, a
block whose holders equal the previous block's costs one comparison, and per-replica counting
happens only where the holder set changes along the chain (usually once or twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from prefixmesh.cache_registry.types import ReplicaId


def iter_bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@lru_cache(maxsize=65536)
def bits_of(mask: int) -> tuple[int, ...]:
    """``iter_bits`` memoised: a fleet's holder sets repeat from lookup to lookup."""
    return tuple(iter_bits(mask))


@dataclass
class ReplicaIndex:
    """Stable small indices for replica ids; an index is reused only after its replica is
    dropped (and so holds no bit anywhere)."""

    index_of: dict[ReplicaId, int] = field(default_factory=dict)
    id_of: dict[int, ReplicaId] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    def assign(self, replica: ReplicaId) -> int:
        index = self.index_of.get(replica)
        if index is None:
            index = self.free.pop() if self.free else len(self.index_of)
            self.index_of[replica] = index
            self.id_of[index] = replica
        return index

    def mask_of(self, replicas: set[ReplicaId]) -> int:
        mask = 0
        for replica in replicas:
            index = self.index_of.get(replica)
            if index is not None:
                mask |= 1 << index
        return mask

    def release(self, replica: ReplicaId) -> None:
        index = self.index_of.pop(replica, None)
        if index is not None:
            del self.id_of[index]
            self.free.append(index)


@dataclass(frozen=True, slots=True)
class RunSegment:
    """``length`` consecutive blocks in which exactly these replicas hold the chain."""

    gpu: int
    cpu: int
    disk: int
    speculative: int
    length: int


Row = tuple[int, int, int, int]
"""Blocks held per tier (gpu, cpu, disk) and how many of them are speculative."""


def count_segments(segments: list[RunSegment]) -> dict[int, Row]:
    """Per replica index, the row of blocks it holds over the walked segments."""
    if len(segments) == 1:  # the common case: one holder set along the whole hit
        only = segments[0]
        length = only.length
        rows: dict[int, Row] = {}
        for mask, held in (
            (only.gpu, (length, 0, 0, 0)),
            (only.cpu, (0, length, 0, 0)),
            (only.disk, (0, 0, length, 0)),
            (only.speculative, (length, 0, 0, length)),
        ):
            if mask:
                rows.update(dict.fromkeys(bits_of(mask), held))
        return rows
    counts: dict[int, list[int]] = {}
    for segment in segments:
        for slot, mask in enumerate((segment.gpu, segment.cpu, segment.disk, segment.speculative)):
            for index in bits_of(mask) if mask else ():
                row = counts.get(index)
                if row is None:
                    row = counts[index] = [0, 0, 0, 0]
                if slot == 3:
                    row[0] += segment.length
                row[slot] += segment.length
    return {index: (r[0], r[1], r[2], r[3]) for index, r in counts.items()}
