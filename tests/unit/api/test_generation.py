from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from prefixmesh.api import render
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


def chars(text: str, index: int, finished: bool = False) -> GenerateChunk:
    return GenerateChunk(tuple(map(ord, text)), finished=finished, replica_id="r", index=index)


async def test_several_choices_each_have_their_text_stop_and_end() -> None:
    """``n`` = 3, interleaved: choice 1 meets its stop string (its later tokens are dropped),
    the others finish; the stream closes after the last end, usage counts every choice."""
    stream = FakeStream(
        [
            chars("ab", 0),
            chars("cX", 1),
            chars("Yz", 1),
            chars("de", 2, finished=True),
            chars("more", 1),
            chars("f", 0, finished=True),
        ]
    )
    generation = Generation(stream, decode, 10, ["XY"], lambda: None, lambda: None, choices=3)
    outputs = await render.collect(await started(generation))
    assert outputs == [
        render.ChoiceOutput("abf"),
        render.ChoiceOutput("c"),
        render.ChoiceOutput("de"),
    ]
    assert generation.usage.completion_tokens == 9  # not "more": choice 1 had stopped
    body = render.full_body("cmpl-1", "m", False, outputs, generation)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "abf"), (1, "c"), (2, "de")]
    chat = render.full_body("chatcmpl-1", "m", True, outputs, generation)
    assert [c["message"]["content"] for c in chat["choices"]] == ["abf", "c", "de"]


async def test_the_stream_closes_once_every_choice_has_ended() -> None:
    stream = FakeStream([chars("a", 0, finished=True), chars("b", 1, finished=True), chars("x", 0)])
    generation = Generation(stream, decode, 1, [], lambda: None, lambda: None, choices=2)
    deltas = [d async for d in (await started(generation)).deltas()]
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [
        (0, "a", "stop"),
        (1, "b", "stop"),
    ]
    assert stream.cancelled and stream.served == 2


async def test_a_chat_stream_of_several_choices_starts_each_with_its_role() -> None:
    stream = FakeStream([chars("a", 1, finished=True), chars("b", 0, finished=True)])
    generation = Generation(stream, decode, 1, [], lambda: None, lambda: None, choices=2)
    events = [
        event
        async for event in render.sse_events(
            await started(generation), "id", "m", True, False, render.mid_stream_error
        )
    ]
    payloads = [json.loads(e.decode()[6:]) for e in events[:-1]]
    roles = [p["choices"][0] for p in payloads[:2]]
    assert [(r["index"], r["delta"]["role"]) for r in roles] == [(0, "assistant"), (1, "assistant")]
    contents = [(p["choices"][0]["index"], p["choices"][0]["delta"]) for p in payloads[2:]]
    assert contents == [(1, {"content": "a"}), (0, {"content": "b"})]
    assert events[-1] == b"data: [DONE]\n\n"


async def started(generation: Generation) -> Generation:
    await generation.first()
    return generation


async def test_a_stop_string_split_over_chunks_never_reaches_the_client() -> None:
    """Regression (issue 38): "X" of the stop string "XY" was sent before "Y" arrived."""
    stream = FakeStream([chars("cX", 0), chars("Yz", 0), chars("never", 0, finished=True)])
    generation, _ = make(stream, stop=["XY"])
    deltas = await collect(generation)
    assert [(d.text, d.finish_reason) for d in deltas] == [("c", None), ("", "stop")]
    held = FakeStream([chars("aX", 0), chars("b", 0, finished=True)])
    generation, _ = make(held, stop=["XY"])
    deltas = await collect(generation)  # "X" is held back, then sent when "b" rules it out
    assert [(d.text, d.finish_reason) for d in deltas] == [("a", None), ("Xb", "stop")]


async def test_a_stream_that_ends_without_finishing_still_gets_its_held_back_text() -> None:
    stream = FakeStream([chars("aX", 0)])  # "X" may begin the stop string "XY"
    generation, _ = make(stream, stop=["XY"])
    deltas = await collect(generation)
    assert [(d.text, d.finish_reason) for d in deltas] == [("a", None), ("X", "stop")]
