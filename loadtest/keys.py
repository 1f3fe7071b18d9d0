"""Prompts as content, and their prefix keys at any block size.

A workload describes a prompt as a sequence of segments, each a run of tokens of one piece of
content (a system prompt, a question, a trace's 512-token block). Block i of a prompt covers
tokens [i * block_size, (i + 1) * block_size); its hash chains the previous block's hash with the
pieces of content it covers (content id, offset, length) through xxh3, so equal content at equal
position gives an equal prefix, at every block size, without materialising tokens. A load test
that sends real text renders token ``offset`` of content ``content_id`` the same way everywhere
(``token_id``), so real engines see the same sharing.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import xxhash

from prefixmesh.cache_registry.types import BlockHash, PrefixKey

_PIECE = struct.Struct("<QII")
_PARENT = struct.Struct("<Q")
_PARENT_PIECE = struct.Struct("<QQII")
"""A block inside one segment (the common case): parent and one piece in one pack."""
_MEMO_LIMIT = 50_000
"""Memoised (parent, segment) expansions kept before the memo starts over (bounds memory)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """``num_tokens`` tokens of content ``content_id`` (from its start)."""

    content_id: int
    num_tokens: int


def prompt_tokens(segments: Sequence[Segment]) -> int:
    return sum(s.num_tokens for s in segments)


def token_id(content_id: int, offset: int, vocab_size: int, reserved: int = 3) -> int:
    """A deterministic token for position ``offset`` of a content (for load tests with text);
    ids below ``reserved`` (BOS, EOS, PAD) are never produced."""
    digest = xxhash.xxh3_64_intdigest(_PIECE.pack(content_id, offset, 0))
    return reserved + digest % (vocab_size - reserved)


class KeyBuilder:
    """Prefix keys of segment sequences at one block size; memoises shared prefixes."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._root = xxhash.xxh3_64_intdigest(f"prefixmesh-sim/{seed}".encode())
        self._memo: dict[
            tuple[int, tuple[tuple[int, int, int], ...], int, int],
            tuple[tuple[BlockHash, ...], int, tuple[tuple[int, int, int], ...]],
        ] = {}

    def key(self, segments: Sequence[Segment]) -> PrefixKey:
        """The chained hashes of every full block of the prompt ``segments`` make up."""
        parent = self._root
        pending: tuple[tuple[int, int, int], ...] = ()
        parts: list[tuple[BlockHash, ...]] = []
        memo = self._memo
        for segment in segments:
            memo_key = (parent, pending, segment.content_id, segment.num_tokens)
            hit = memo.get(memo_key)
            if hit is None:
                hit = self._expand(parent, pending, segment)
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()
                memo[memo_key] = hit
            hashes, parent, pending = hit
            if hashes:
                parts.append(hashes)
        if len(parts) == 1:
            return PrefixKey(parts[0], self.block_size)
        return PrefixKey(tuple(chain.from_iterable(parts)), self.block_size)

    def _expand(
        self, parent: int, pending: tuple[tuple[int, int, int], ...], segment: Segment
    ) -> tuple[tuple[BlockHash, ...], int, tuple[tuple[int, int, int], ...]]:
        size = self.block_size
        filled = sum(piece[2] for piece in pending)
        pieces = list(pending)
        hashes: list[BlockHash] = []
        offset = 0
        digest = xxhash.xxh3_64_intdigest
        cid, length = segment.content_id, segment.num_tokens
        if not pieces:
            # Whole blocks inside this segment: one pack and one digest each.
            pack = _PARENT_PIECE.pack
            whole_end = (length // size) * size
            for start in range(0, whole_end, size):
                parent = digest(pack(parent, cid, start, size))
                hashes.append(BlockHash(parent))
            offset = whole_end
        while offset < length:
            take = min(size - filled, length - offset)
            pieces.append((cid, offset, take))
            filled += take
            offset += take
            if filled == size:
                data = _PARENT.pack(parent) + b"".join(_PIECE.pack(*p) for p in pieces)
                parent = digest(data)
                hashes.append(BlockHash(parent))
                pieces, filled = [], 0
        return tuple(hashes), parent, tuple(pieces)
