from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.cache_registry.hashing import BlockHasher, CacheFingerprint

BLOCK = 4
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)


def test_golden_values_pin_the_format() -> None:
    """Keys must be identical on every machine and in every release that shares a registry;
    changing the hash format must be deliberate (bump the format version)."""
    hasher = BlockHasher(block_size=4, model="demo", hash_algo="xxh3_64", seed=7)
    key = hasher.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [f"{h:016x}" for h in key.block_hashes] == GOLDEN_XXH3
    blake = BlockHasher(block_size=4, model="demo", hash_algo="blake2b_64", seed=7)
    assert [f"{h:016x}" for h in blake.hash_tokens([1, 2, 3, 4]).block_hashes] == GOLDEN_BLAKE


GOLDEN_XXH3 = ["73e19503c3423c6b", "323b2fd3efb7557a"]
GOLDEN_BLAKE = ["84cc6d878b0626d6"]


def test_matches_the_documented_chain() -> None:
    """h_i = H(h_{i-1} as 8 little-endian bytes || block tokens as little-endian uint32)."""
    hasher = BlockHasher(block_size=2, model="demo", seed=1)
    fingerprint = hasher.fingerprint.to_json()
    root = xxhash.xxh3_64_intdigest(f"prefixmesh-blockhash-v1\x1f{fingerprint}".encode())
    first = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + struct.pack("<2I", 10, 11))
    second = xxhash.xxh3_64_intdigest(first.to_bytes(8, "little") + struct.pack("<2I", 12, 13))
    assert hasher.hash_tokens([10, 11, 12, 13]).block_hashes == (first, second)


def test_same_keys_in_another_process() -> None:
    code = (
        "from prefixmesh.cache_registry.hashing import BlockHasher;"
        "print(BlockHasher(16, 'm', seed=3).hash_tokens(list(range(100)), ('lora-a',))"
        ".block_hashes)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout.strip()
    mine = BlockHasher(16, "m", seed=3).hash_tokens(list(range(100)), ("lora-a",)).block_hashes
    assert other == str(mine)


def test_partial_trailing_block_is_not_hashed() -> None:
    hasher = BlockHasher(BLOCK, "m")
    assert len(hasher.hash_tokens(list(range(11)))) == 2
    assert hasher.hash_tokens(list(range(11))) == hasher.hash_tokens(list(range(8)))
    assert len(hasher.hash_tokens([1, 2, 3])) == 0
    assert hasher.hash_tokens(list(range(11))).num_tokens == 8


@pytest.mark.parametrize(
    "other",
    [
        BlockHasher(BLOCK, "m", seed=1),
        BlockHasher(BLOCK, "other-model"),
        BlockHasher(BLOCK, "m", hash_algo="blake2b_64"),
    ],
)
def test_seed_model_and_algorithm_change_every_key(other: BlockHasher) -> None:
    tokens = list(range(16))
    mine = BlockHasher(BLOCK, "m").hash_tokens(tokens).block_hashes
    theirs = other.hash_tokens(tokens).block_hashes
    assert all(a != b for a, b in zip(mine, theirs, strict=True))


def test_extra_keys_namespace_every_block() -> None:
    hasher = BlockHasher(BLOCK, "m")
    tokens = list(range(16))
    plain = hasher.hash_tokens(tokens).block_hashes
    for extra in [("lora-a",), ("lora-b",), ("lora-a", "salt"), (b"\x01",), (1,), ("1",)]:
        keyed = hasher.hash_tokens(tokens, extra).block_hashes
        assert all(a != b for a, b in zip(plain, keyed, strict=True)), extra
    assert hasher.hash_tokens(tokens, (1,)) != hasher.hash_tokens(tokens, ("1",))


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_invalid_token_ids_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher(1, "m").hash_tokens(bad)  # type: ignore[arg-type]


def test_invalid_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0, "m")
    with pytest.raises(ValueError, match="hash_algo"):
        BlockHasher(4, "m", hash_algo="md5")


def test_fingerprint_round_trips_json() -> None:
    fp = BlockHasher(32, "m", seed=5).fingerprint
    assert fp == CacheFingerprint(32, "xxh3_64", 5, "m")
    assert CacheFingerprint.from_json(fp.to_json()) == fp


def test_prefix_key_head_and_last() -> None:
    key = BlockHasher(BLOCK, "m").hash_tokens(list(range(12)))
    assert key.head(2).block_hashes == key.block_hashes[:2]
    assert key.last == key.block_hashes[-1]
    assert key.head(0).last is None


@settings(max_examples=200, deadline=None)
@given(common=token_lists, tail_a=token_lists, tail_b=token_lists)
def test_equal_prefixes_give_equal_leading_keys(
    common: list[int], tail_a: list[int], tail_b: list[int]
) -> None:
    hasher = BlockHasher(BLOCK, "m")
    a = hasher.hash_tokens(common + tail_a).block_hashes
    b = hasher.hash_tokens(common + tail_b).block_hashes
    shared = len(common) // BLOCK
    assert a[:shared] == b[:shared]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=BLOCK, max_size=64),
    data=st.data(),
)
def test_a_change_in_block_i_changes_keys_i_onwards_only(
    tokens: list[int], data: st.DataObject
) -> None:
    hasher = BlockHasher(BLOCK, "m")
    num_full = len(tokens) // BLOCK * BLOCK
    position = data.draw(st.integers(0, num_full - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    before = hasher.hash_tokens(tokens).block_hashes
    after = hasher.hash_tokens(changed).block_hashes
    block = position // BLOCK
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:], strict=True))


def test_chain_continues_from_a_parent() -> None:
    hasher = BlockHasher(BLOCK, "m")
    whole = hasher.hash_tokens(list(range(20))).block_hashes
    head = hasher.chain(None, list(range(8)))
    tail = hasher.chain(head[-1], list(range(8, 20)))
    assert head + tail == whole


def test_shared_blocks_finds_the_boundary_of_two_chains_up_to_a_limit() -> None:
    from prefixmesh.cache_registry.hashing import shared_blocks

    a = (1, 2, 3, 4, 5, 6)
    b = (1, 2, 3, 4, 9, 9, 9)
    assert shared_blocks(a, b) == 4
    assert shared_blocks(a, b, 3) == 3
    assert shared_blocks(a, b, 10) == 4
    assert shared_blocks(a, a, 0) == 0
    assert shared_blocks(a, ()) == 0
