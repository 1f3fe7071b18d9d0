"""Prompt keys from content segments: equal content at equal position = equal prefix."""

from __future__ import annotations

from prefixmesh.loadtest.keys import KeyBuilder, Segment, prompt_tokens, token_id


def test_equal_leading_content_gives_equal_leading_blocks() -> None:
    keys = KeyBuilder(16)
    a = keys.key([Segment(1, 64), Segment(2, 40)])
    b = keys.key([Segment(1, 64), Segment(3, 40)])
    assert len(a) == 6  # 104 tokens: 6 full blocks of 16
    assert a.block_hashes[:4] == b.block_hashes[:4]
    assert a.block_hashes[4] != b.block_hashes[4]


def test_the_same_content_at_another_position_differs() -> None:
    keys = KeyBuilder(16)
    a = keys.key([Segment(1, 32)])
    b = keys.key([Segment(9, 16), Segment(1, 32)])
    assert set(a.block_hashes).isdisjoint(b.block_hashes)


def test_blocks_may_span_segments_and_memo_agrees_with_fresh_builders() -> None:
    segments = [Segment(1, 10), Segment(2, 30), Segment(3, 7)]
    assert prompt_tokens(segments) == 47
    warm = KeyBuilder(16)
    warm.key(segments)
    again = warm.key(segments)
    assert again == KeyBuilder(16).key(segments)
    assert len(again) == 2
    # Splitting a segment's content differently changes block content, hence the hashes.
    other = KeyBuilder(16).key([Segment(1, 10), Segment(2, 38)])
    assert other.block_hashes[0] == again.block_hashes[0]
    assert other.block_hashes[1] == again.block_hashes[1]  # tokens 16-31: content 2 at 6..21
    assert len(other) == 3


def test_block_size_and_seed_change_keys() -> None:
    segments = [Segment(1, 512)]
    assert len(KeyBuilder(16).key(segments)) == 32
    assert len(KeyBuilder(128).key(segments)) == 4
    assert KeyBuilder(16, seed=1).key(segments) != KeyBuilder(16).key(segments)


def test_token_ids_are_deterministic_and_skip_reserved_ids() -> None:
    tokens = [token_id(7, offset, vocab_size=100) for offset in range(1000)]
    assert tokens == [token_id(7, offset, vocab_size=100) for offset in range(1000)]
    assert min(tokens) >= 3 and max(tokens) < 100
