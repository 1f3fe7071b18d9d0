"""Reading a streamed response: TTFT at the first generated text, gaps between events, usage."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from prefixmesh.loadtest.sse import read_stream
from tests.fakes.clock import FakeClock


def feed(events: list[tuple[float, object]], clock: FakeClock) -> Callable[[], bytes]:
    """A readline over SSE lines; each line arrives ``dt`` after the previous one."""

    def lines() -> Iterator[bytes]:
        for dt, event in events:
            clock.advance(dt)
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n".encode()
            yield b"\n"

    it = lines()
    return lambda: next(it, b"")


def chunk(text: str | None = None, finish: str | None = None, chat: bool = False) -> dict:
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    return {"choices": [choice]}


def test_completions_stream() -> None:
    clock = FakeClock(0.0)
    usage = {
        "prompt_tokens": 300,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 256},
    }
    readline = feed(
        [
            (0.10, chunk("a")),
            (0.02, chunk("b")),
            (0.03, chunk("", finish="length")),
            (0.00, {"choices": [], "usage": usage}),
            (0.00, "[DONE]"),
        ],
        clock,
    )
    result = read_stream(readline, 0.0, clock)
    assert result.ok and result.ttft_s == pytest.approx(0.10)
    assert [round(g, 6) for g in result.itl_s] == [0.02, 0.03]
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (300, 256, 3)
    assert result.finish_reason == "length" and result.e2e_s == pytest.approx(0.15)


def test_chat_role_chunk_is_not_a_token() -> None:
    clock = FakeClock(0.0)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    readline = feed(
        [(0.01, role), (0.2, chunk("x", chat=True)), (0.1, chunk(None, "stop", chat=True))],
        clock,
    )
    result = read_stream(readline, 0.0, clock)
    assert result.ttft_s == pytest.approx(0.21) and len(result.event_times_s) == 2


def test_an_error_event_or_an_empty_stream_fails_the_request() -> None:
    clock = FakeClock(0.0)
    error = {"error": {"message": "the replica failed", "type": "server_error"}}
    result = read_stream(feed([(0.1, chunk("a")), (0.1, error)], clock), 0.0, clock)
    assert not result.ok and "replica failed" in result.error
    empty = read_stream(feed([(0.1, "[DONE]")], clock), 0.0, clock)
    assert not empty.ok and "without a token" in empty.error
