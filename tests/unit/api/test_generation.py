from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefixmesh.api.generation import Generation, TextDelta
from prefixmesh.wire import GenerateChunk


class FakeStream:
    """The replica's token stream as the handle gives it (an async iterator with cancel())."""

    def __init__(self, chunks: list[GenerateChunk], fail_after: int | None = None) -> None:
        self._chunks = list(chunks)
        self._fail_after = fail_after
        self.cancelled = False
        self.served = 0

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._fail_after is not None and self.served >= self._fail_after:
            raise RuntimeError("replica died")
        if not self._chunks:
            raise StopAsyncIteration
        self.served += 1
        return self._chunks.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def make(stream: FakeStream, stop: list[str] | None = None) -> tuple[Generation, list[str]]:
    calls: list[str] = []
    generation = Generation(
        stream, decode, 10, stop or [], lambda: calls.append("first"), lambda: calls.append("end")
    )
    return generation, calls


async def collect(generation: Generation) -> list[TextDelta]:
    await generation.first()
    return [d async for d in generation.deltas()]


async def test_text_usage_and_lifecycle() -> None:
    stream = FakeStream(
        [
            GenerateChunk((ord("a"),), num_cached_tokens=4, replica_id="r1"),
            GenerateChunk((ord("b"), ord("c")), finished=True, finish_reason="length"),
        ]
    )
    generation, calls = make(stream)
    deltas = await collect(generation)
    assert deltas == [TextDelta("a"), TextDelta("bc", "length")]
    assert generation.replica_id == "r1"
    assert generation.usage.as_dict() == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert calls == ["first", "end"]


async def test_a_stop_string_cuts_the_text_and_aborts_the_stream() -> None:
    stream = FakeStream(
        [
            GenerateChunk(tuple(map(ord, "ab")), replica_id="r"),
            GenerateChunk(tuple(map(ord, "cXYd"))),
            GenerateChunk(tuple(map(ord, "never")), finished=True),
        ]
    )
    generation, calls = make(stream, stop=["XY"])
    deltas = await collect(generation)
    assert "".join(d.text for d in deltas) == "abc"
    assert deltas[-1].finish_reason == "stop"
    assert stream.cancelled and calls == ["first", "end"]


async def test_a_failure_mid_stream_still_ends_the_request() -> None:
    stream = FakeStream(
        [GenerateChunk((ord("a"),), replica_id="r"), GenerateChunk((ord("b"),))], fail_after=1
    )
    generation, calls = make(stream)
    await generation.first()
    with pytest.raises(RuntimeError):
        _ = [d async for d in generation.deltas()]
    assert stream.cancelled and calls == ["first", "end"]


async def test_close_is_idempotent() -> None:
    stream = FakeStream([])
    generation, calls = make(stream)
    generation.close()
    generation.close()
    assert calls == ["end"]
