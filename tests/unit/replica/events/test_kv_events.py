"""Translating vLLM's KV events into our keys (fakes shaped like vLLM's msgspec structs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import EventKind, Tier
from prefixmesh.replica.engines.base import Residency
from prefixmesh.replica.events.kv_events import VllmEventStream, VllmEventTranslator

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
    ownership: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = "GPU"
    ownership: str | None = None


class AllBlocksCleared:
    pass


def test_stored_blocks_get_the_router_keys_even_when_split_across_events() -> None:
    translator = VllmEventTranslator(HASHER)
    [first] = translator.translate([BlockStored([b"v0", b"v1"], None, TOKENS[:8])])
    [second] = translator.translate([BlockStored([b"v2", b"v3"], b"v1", TOKENS[8:16])])
    assert (first.kind, first.tier) == (EventKind.STORED, Tier.GPU)
    assert first.block_hashes + second.block_hashes == KEY
    assert translator.residency().blocks() == KEY


def test_removed_and_cleared() -> None:
    translator = VllmEventTranslator(HASHER)
    translator.translate([BlockStored([b"v0", b"v1", b"v2", b"v3"], None, TOKENS)])
    [removed] = translator.translate([BlockRemoved([b"v3", b"unknown"])])
    assert removed.block_hashes == KEY[3:]
    assert translator.translate([BlockRemoved([b"unknown"])]) == []
    [cleared] = translator.translate([AllBlocksCleared()])
    assert cleared.kind is EventKind.CLEARED and cleared.tier is Tier.GPU
    assert translator.residency().blocks() == ()


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


def test_a_stream_gap_clears_instead_of_guessing() -> None:
    stream = VllmEventStream(VllmEventTranslator(HASHER))
    [first] = stream.batch(0, [BlockStored([b"v0", b"v1"], None, TOKENS[:8])])
    assert first.kind is EventKind.STORED
    assert stream.batch(1, [BlockRemoved([b"v1"])])[0].kind is EventKind.REMOVED
    # Batch 2 is lost: it may have removed v0 (the registry would keep a block the engine
    # dropped) or stored v1's children (they could never be translated).
    changes = stream.batch(3, [BlockStored([b"v2"], b"v1-again", TOKENS[4:8])])
    assert [(c.kind, c.tier) for c in changes] == [(EventKind.CLEARED, None)]
    assert stream.translator.residency().tiers == () and stream.gaps == 1
    # Later stores from the root translate again; an unknown parent now only under-reports.
    [stored] = stream.batch(4, [BlockStored([b"w0", b"w1"], None, TOKENS[:8])])
    assert stored.block_hashes == KEY[:2]
    assert stream.batch(5, [BlockStored([b"x"], b"unknown", TOKENS[8:12])]) == []
    assert stream.gaps == 1


def test_an_unknown_parent_in_a_complete_stream_clears_once() -> None:
    stream = VllmEventStream(VllmEventTranslator(HASHER))
    stored = BlockStored([b"v0"], None, TOKENS[:4])
    orphan = BlockStored([b"v2"], b"lost", TOKENS[8:12])
    changes = stream.batch(0, [stored, orphan])  # an event lost without a missing number
    assert [c.kind for c in changes] == [EventKind.STORED, EventKind.CLEARED]
    assert stream.batch(1, [orphan]) == [] and stream.gaps == 1  # expected after a reset
    # The engine cleared its cache: the view is complete again, an orphan is news again.
    assert stream.batch(2, [AllBlocksCleared()])[0].kind is EventKind.CLEARED
    assert [c.kind for c in stream.batch(3, [orphan])] == [EventKind.CLEARED]
    assert stream.gaps == 2


def test_an_undecodable_batch_counts_as_lost() -> None:
    stream = VllmEventStream(VllmEventTranslator(HASHER))
    stream.batch(0, [BlockStored([b"v0"], None, TOKENS[:4])])
    assert [c.kind for c in stream.batch(1, None)] == [EventKind.CLEARED]
    assert stream.translator.residency().tiers == () and stream.next_seq == 2
    bad_size = BlockStored([b"v0"], None, TOKENS[:8], block_size=8)
    assert [c.kind for c in stream.batch(2, [bad_size])] == [EventKind.CLEARED]
    assert stream.gaps == 2


def test_a_restarted_publisher_counting_from_zero_is_a_gap() -> None:
    stream = VllmEventStream(VllmEventTranslator(HASHER))
    stream.batch(0, [BlockStored([b"v0"], None, TOKENS[:4])])
    stream.batch(1, [])
    assert [c.kind for c in stream.batch(0, [])] == [EventKind.CLEARED]
    assert stream.next_seq == 1


def test_our_connectors_events_carry_our_hashes_and_their_tier() -> None:
    """The KV connector names blocks by our own hashes (ownership "prefixmesh"): no token ids,
    no parents, and the engine tier's map is left alone."""
    translator = VllmEventTranslator(HASHER)
    translator.translate([BlockStored([b"v0"], None, TOKENS[:4])])
    ours = [int(h) for h in KEY[:2]]
    own = "prefixmesh"
    stored = BlockStored(ours, None, [], block_size=999, medium="CPU", ownership=own)
    moved = [
        BlockRemoved(ours[1:], medium="CPU", ownership=own),
        BlockStored(ours[1:], None, [], medium="DISK", ownership=own),
    ]
    changes = translator.translate([stored, *moved, BlockRemoved(ours, "GPU", ownership=own)])
    assert [(c.kind, c.tier, c.block_hashes) for c in changes] == [
        (EventKind.STORED, Tier.CPU, KEY[:2]),
        (EventKind.REMOVED, Tier.CPU, KEY[1:2]),
        (EventKind.STORED, Tier.DISK, KEY[1:2]),
    ]
    assert translator.residency() == Residency(
        ((Tier.GPU, KEY[:1]), (Tier.CPU, KEY[:1]), (Tier.DISK, KEY[1:2]))
    )
    assert translator.untranslatable == 0


def test_clearing_the_engines_cache_keeps_the_connectors_tiers() -> None:
    """Regression: vLLM's AllBlocksCleared (reset_prefix_cache clears the engine's own cache)
    became a CLEARED of every tier, so the registry forgot the CPU and disk blocks our
    connector still held, and so did the next resync snapshot."""
    translator = VllmEventTranslator(HASHER)
    ours = [int(h) for h in KEY[:2]]
    translator.translate([BlockStored([b"v0", b"v1"], None, TOKENS[:8])])
    translator.translate([BlockStored(ours, None, [], medium="CPU", ownership="prefixmesh")])
    [cleared] = translator.translate([AllBlocksCleared()])
    assert (cleared.kind, cleared.tier) == (EventKind.CLEARED, Tier.GPU)
    assert translator.residency() == Residency(((Tier.CPU, KEY[:2]),))


def test_a_lost_batch_forgets_the_lower_tiers_too() -> None:
    """Our connector's events travel in the same numbered batches: after a gap its tiers are
    unknown as well, and the registry is told to clear them (it under-reports, never lies)."""
    stream = VllmEventStream(VllmEventTranslator(HASHER))
    own = BlockStored([int(KEY[0])], None, [], medium="DISK", ownership="prefixmesh")
    stream.batch(0, [own])
    assert stream.translator.residency().blocks(Tier.DISK) == KEY[:1]
    [cleared] = stream.batch(2, [])
    assert (cleared.kind, cleared.tier) == (EventKind.CLEARED, None)
    assert stream.translator.residency().tiers == ()
