"""Chained block hashing of token ids: h_i = H(h_{i-1}, tokens of block i).

The chain starts from a root derived from the seed, the model and the request's extra keys (LoRA
name, cache salt), so a change in any of them changes every block's hash, exactly as if the extra
keys were mixed into each block, at no per-block cost. Token ids are hashed as little-endian
uint32, never through Python's ``hash()``, so keys agree across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal, get_args

import xxhash

from prefixmesh.cache_registry.types import BlockHash, PrefixKey

HashAlgo = Literal["xxh3_64", "blake2b_64"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
_FORMAT_VERSION = "prefixmesh-blockhash-v1"
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_NEEDS_BYTESWAP = sys.byteorder != "little"

ExtraKey = str | int | bytes


def _blake2b_64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_DIGESTS: dict[str, Callable[[bytes], int]] = {
    "xxh3_64": xxhash.xxh3_64_intdigest,
    "blake2b_64": _blake2b_64,
}


@dataclass(frozen=True, slots=True)
class CacheFingerprint:
    """Everything that decides the value of a block key. Processes that share a registry must
    agree on it; a registry refuses a client whose fingerprint differs from the one it holds."""

    block_size: int
    hash_algo: str
    seed: int
    model: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> CacheFingerprint:
        return cls(**json.loads(text))


class FingerprintMismatchError(RuntimeError):
    """Two processes would compute different keys for the same prompt."""


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; rejects ids outside [0, 2**32)."""
    try:
        packed = array(_UINT32, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Hashes prompts into ``PrefixKey``s for one model, block size, algorithm and seed."""

    def __init__(
        self, block_size: int, model: str, hash_algo: str = "xxh3_64", seed: int = 0
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if hash_algo not in _DIGESTS:
            raise ValueError(f"unknown hash_algo {hash_algo!r}; choose one of {HASH_ALGOS}")
        self.block_size = block_size
        self.fingerprint = CacheFingerprint(block_size, hash_algo, seed, model)
        self._digest = _DIGESTS[hash_algo]
        self._root = lru_cache(maxsize=1024)(self._compute_root)

    def _compute_root(self, extra_keys: tuple[ExtraKey, ...]) -> bytes:
        parts = [_FORMAT_VERSION, self.fingerprint.to_json()]
        parts += [
            k.hex() if isinstance(k, bytes) else f"{type(k).__name__}:{k}" for k in extra_keys
        ]
        root = self._digest("\x1f".join(parts).encode())
        return root.to_bytes(8, "little")

    def hash_tokens(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
    ) -> PrefixKey:
        """The chained hashes of every full block of ``token_ids``."""
        return PrefixKey(self.chain(None, token_ids, extra_keys), self.block_size)

    def chain(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> tuple[BlockHash, ...]:
        """Hashes of the full blocks of ``token_ids``, continuing the chain after ``parent``
        (``None``: from the root). Lets a replica hash the blocks an engine reports stored,
        given the hash of the block before them."""
        size = self.block_size
        num_blocks = len(token_ids) // size
        data = tokens_to_bytes(token_ids[: num_blocks * size])
        stride = size * 4
        previous = self._root(extra_keys) if parent is None else parent.to_bytes(8, "little")
        digest = self._digest
        hashes: list[BlockHash] = []
        for offset in range(0, num_blocks * stride, stride):
            value = digest(previous + data[offset : offset + stride])
            hashes.append(BlockHash(value))
            previous = value.to_bytes(8, "little")
        return tuple(hashes)


def shared_blocks(a: Sequence[BlockHash], b: Sequence[BlockHash], limit: int | None = None) -> int:
    """Leading blocks two hash chains share, up to ``limit``. Chained hashes are equal at i only
    if equal before i (each covers its whole prefix), so a binary search finds the boundary in
    O(log n) comparisons."""
    low, high = 0, min(len(a), len(b))
    if limit is not None and limit < high:
        high = limit
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
