"""Trace parsers on small inline samples of the Mooncake and Qwen-Bailian formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.loadtest.keys import KeyBuilder, Segment
from prefixmesh.loadtest.traces import (
    detect_format,
    load_trace,
    parse_mooncake,
    parse_qwen,
    rescale,
)

MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 40, "input_length": 1024, "output_length": 0, "hash_ids": [0, 1]},
    {"timestamp": 20, "input_length": 600, "output_length": 9, "hash_ids": [0, 7]},
]

QWEN = [
    {"chat_id": 10, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40,
     "output_length": 20, "hash_ids": [1, 2, 3], "turn": 1, "type": "text"},
    {"chat_id": 11, "parent_chat_id": 10, "timestamp": 9.0, "input_length": 90,
     "output_length": 4, "hash_ids": [1, 2, 4, 5, 6, 7], "turn": 2, "type": "text"},
    {"chat_id": 12, "parent_chat_id": -1, "timestamp": 3.0, "input_length": 16,
     "output_length": 1, "hash_ids": [8], "turn": 1, "type": "search"},
]  # fmt: skip


def lines(records: list[dict[str, object]]) -> list[str]:
    return [json.dumps(r) for r in records]


def test_mooncake_blocks_become_segments_and_partial_tails_are_unique() -> None:
    requests = parse_mooncake(lines(MOONCAKE))
    assert [r.arrival_s for r in requests] == [0.0, 0.02, 0.04]  # sorted, ms -> s
    first, third, second = requests
    assert first.segments[:2] == (Segment(0, 512), Segment(1, 512))
    assert first.segments[2].num_tokens == 76 and first.segments[2].content_id >= 1 << 48
    assert first.prompt_tokens == 1100 and first.output_tokens == 5
    assert second.segments == (Segment(0, 512), Segment(1, 512))
    assert second.output_tokens == 1  # at least the first token
    assert third.segments[0] == Segment(0, 512) and third.segments[1].num_tokens == 88
    assert third.segments[1] != first.segments[2]
    keys = KeyBuilder(16)
    assert len(keys.key(first.segments)) == 68  # 1100 // 16
    assert keys.key(first.segments).block_hashes[:64] == keys.key(second.segments).block_hashes


def test_qwen_records_link_parents_to_the_answer_their_child_repeats() -> None:
    requests = parse_qwen(lines(QWEN))
    assert [r.request_id for r in requests] == ["qwen-10", "qwen-12", "qwen-11"]
    parent, search, child = requests
    assert parent.segments == (Segment(1, 16), Segment(2, 16), parent.segments[2])
    assert parent.segments[2].num_tokens == 8  # 40 = 2 full blocks + 8 unique tokens
    # the parent's prompt + answer is 60 tokens: the child's first 3 full blocks
    assert parent.finish_segments == (Segment(1, 16), Segment(2, 16), Segment(4, 16))
    assert child.finish_segments is None and search.kind == "search"
    keys = KeyBuilder(16)
    finish = keys.key(parent.finish_segments)
    assert keys.key(child.segments).block_hashes[:3] == finish.block_hashes


def test_format_detection_and_loading_from_a_file(tmp_path: Path) -> None:
    assert detect_format(MOONCAKE[0]) == "mooncake"
    assert detect_format(QWEN[0]) == "qwen"
    with pytest.raises(ValueError):
        detect_format({"foo": 1})
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines(QWEN)) + "\n\n")
    assert len(load_trace(path)) == 3
    path.write_text("\n".join(lines(MOONCAKE)))
    assert next(r.request_id for r in load_trace(path, "mooncake")) == "mooncake-0"
    path.write_text("{not json\n")
    with pytest.raises(ValueError):
        load_trace(path)


def test_rescale_multiplies_arrival_times() -> None:
    requests = parse_mooncake(lines(MOONCAKE))
    assert [r.arrival_s for r in rescale(requests, 0.5)] == [0.0, 0.01, 0.02]
    with pytest.raises(ValueError):
        rescale(requests, 0.0)


def test_the_shipped_mooncake_trace_parses(mooncake_trace: Path) -> None:
    requests = load_trace(mooncake_trace)
    assert len(requests) == 3993
    assert sum(r.prompt_tokens for r in requests) / len(requests) == pytest.approx(15325, abs=1)
