"""Translating vLLM's KV events into our keys (fakes shaped like vLLM's msgspec structs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import EventKind, Tier
from prefixmesh.replica.kv_events import VllmEventTranslator

HASHER = BlockHasher(4, "m")
TOKENS = list(range(16))
KEY = HASHER.hash_tokens(TOKENS).block_hashes


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int = 4
    medium: str | None = "GPU"


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = "GPU"


class AllBlocksCleared:
    pass


def test_stored_blocks_get_the_router_keys_even_when_split_across_events() -> None:
    translator = VllmEventTranslator(HASHER)
    [first] = translator.translate([BlockStored([b"v0", b"v1"], None, TOKENS[:8])])
    [second] = translator.translate([BlockStored([b"v2", b"v3"], b"v1", TOKENS[8:16])])
    assert (first.kind, first.tier) == (EventKind.STORED, Tier.GPU)
    assert first.block_hashes + second.block_hashes == KEY
    assert translator.held_blocks() == KEY


def test_removed_and_cleared() -> None:
    translator = VllmEventTranslator(HASHER)
    translator.translate([BlockStored([b"v0", b"v1", b"v2", b"v3"], None, TOKENS)])
    [removed] = translator.translate([BlockRemoved([b"v3", b"unknown"])])
    assert removed.block_hashes == KEY[3:]
    assert translator.translate([BlockRemoved([b"unknown"])]) == []
    [cleared] = translator.translate([AllBlocksCleared()])
    assert cleared.kind is EventKind.CLEARED and cleared.tier is None
    assert translator.held_blocks() == ()


def test_an_unknown_parent_is_skipped_and_counted() -> None:
    translator = VllmEventTranslator(HASHER)
    assert translator.translate([BlockStored([b"v2"], b"lost", TOKENS[8:12])]) == []
    assert translator.untranslatable == 1


def test_a_block_size_mismatch_fails_loudly() -> None:
    with pytest.raises(ValueError, match="block size"):
        VllmEventTranslator(HASHER).translate([BlockStored([b"v0"], None, TOKENS[:8], 8)])


def test_cpu_medium_maps_to_the_cpu_tier() -> None:
    translator = VllmEventTranslator(HASHER)
    [change] = translator.translate([BlockStored([b"v0"], None, TOKENS[:4], medium="CPU")])
    assert change.tier is Tier.CPU
