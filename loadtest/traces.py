"""Trace replay: the Mooncake and Qwen-Bailian JSONL formats, as workload requests.

Both formats give each prompt as one hash id per fixed-size block of input tokens (equal ids at
equal positions = equal content, and ids are assigned along chains, so a shared leading run of
ids is a shared prefix):

- Mooncake (kvcache-ai/Mooncake, FAST'25): ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` per 512-token block.
- Qwen-Bailian (alibaba-edu/qwen-bailian-usagetraces-anon, seed-003 section 2): ``chat_id``,
  ``parent_chat_id`` (-1 for a first turn), ``timestamp`` (s), ``input_length``,
  ``output_length``, ``hash_ids`` per 16-token block, ``turn``, ``type``.

Each full trace block becomes one content segment, so the simulator re-cuts it into engine blocks
of any size (a 512-token block is 32 blocks of 16). A partial last block is not cacheable: its
tokens get content of their own that nothing else shares.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from prefixmesh.loadtest.keys import Segment
from prefixmesh.loadtest.workloads import WorkloadRequest, make_request

TraceFormat = Literal["mooncake", "qwen"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("mooncake", "qwen")
MOONCAKE_BLOCK_TOKENS = 512
QWEN_BLOCK_TOKENS = 16
_UNIQUE_CONTENT_BASE = 1 << 48
"""Content ids for unshared tokens start here, far above any trace's hash ids."""


def detect_format(record: Mapping[str, Any]) -> TraceFormat:
    if "chat_id" in record or "parent_chat_id" in record:
        return "qwen"
    if "hash_ids" in record and "input_length" in record:
        return "mooncake"
    raise ValueError(f"not a Mooncake or Qwen-Bailian trace record: keys {sorted(record)}")


def _records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise ValueError(f"line {number}: expected an object")
        yield record


def _segments(
    hash_ids: Sequence[int], input_length: int, block_tokens: int, unique: Iterator[int]
) -> tuple[Segment, ...]:
    full = input_length // block_tokens
    segments = [Segment(int(h), block_tokens) for h in hash_ids[:full]]
    # A trace with fewer ids than full blocks: the rest is content nothing else shares.
    rest = input_length - len(segments) * block_tokens
    if rest:
        segments.append(Segment(next(unique), rest))
    return tuple(segments)


def parse_mooncake(lines: Iterable[str]) -> list[WorkloadRequest]:
    unique = itertools.count(_UNIQUE_CONTENT_BASE)
    requests = []
    for i, record in enumerate(_records(lines)):
        segments = _segments(
            record["hash_ids"], int(record["input_length"]), MOONCAKE_BLOCK_TOKENS, unique
        )
        requests.append(
            make_request(
                f"mooncake-{i}",
                float(record["timestamp"]) / 1000.0,
                segments,
                max(1, int(record["output_length"])),
                kind="trace",
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def parse_qwen(lines: Iterable[str]) -> list[WorkloadRequest]:
    """Qwen-Bailian records; a parent turn whose child repeats its answer gets
    ``finish_segments`` (the child's prompt up to the end of that answer), so the engine caches
    the answer's blocks at finish as vLLM does."""
    unique = itertools.count(_UNIQUE_CONTENT_BASE)
    records = list(_records(lines))
    by_chat: dict[str, dict[str, Any]] = {}
    segments_of: dict[str, tuple[Segment, ...]] = {}
    first_child: dict[str, str] = {}
    for record in records:
        chat = str(record["chat_id"])
        by_chat[chat] = record
        segments_of[chat] = _segments(
            record["hash_ids"], int(record["input_length"]), QWEN_BLOCK_TOKENS, unique
        )
        parent = str(record.get("parent_chat_id", -1))
        if parent not in ("-1", "None", ""):
            first_child.setdefault(parent, chat)
    requests = []
    for record in records:
        chat = str(record["chat_id"])
        finish = None
        child = first_child.get(chat)
        if child is not None:
            finish = _answer_prefix(
                segments_of[chat],
                segments_of[child],
                int(record["input_length"]) + int(record["output_length"]),
            )
        requests.append(
            make_request(
                f"qwen-{chat}",
                float(record["timestamp"]),
                segments_of[chat],
                max(1, int(record["output_length"])),
                finish_segments=finish,
                kind=str(record.get("type", "trace")),
            )
        )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _answer_prefix(
    parent: tuple[Segment, ...], child: tuple[Segment, ...], num_tokens: int
) -> tuple[Segment, ...] | None:
    """The child's prompt cut to ``num_tokens`` tokens, if it extends the parent's full blocks."""
    full = [s for s in parent if s.num_tokens == QWEN_BLOCK_TOKENS]
    if list(child[: len(full)]) != full:
        return None
    cut: list[Segment] = []
    total = 0
    for segment in child:
        if total + segment.num_tokens > num_tokens:
            break
        cut.append(segment)
        total += segment.num_tokens
    return tuple(cut) if len(cut) > len(full) else None


def load_trace(path: str | Path, fmt: TraceFormat | None = None) -> list[WorkloadRequest]:
    """Requests of a JSONL trace, sorted by arrival; ``fmt`` None detects it from line one."""
    text = Path(path).read_text().splitlines()
    if fmt is None:
        first = next(_records(text), None)
        if first is None:
            raise ValueError(f"{path}: empty trace")
        fmt = detect_format(first)
    if fmt == "mooncake":
        return parse_mooncake(text)
    if fmt == "qwen":
        return parse_qwen(text)
    raise ValueError(f"unknown trace format {fmt!r}; choose one of {TRACE_FORMATS}")


def rescale(requests: Sequence[WorkloadRequest], factor: float) -> list[WorkloadRequest]:
    """The same requests with arrival times multiplied by ``factor`` (< 1 plays faster)."""
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return [replace(r, arrival_s=r.arrival_s * factor) for r in requests]
