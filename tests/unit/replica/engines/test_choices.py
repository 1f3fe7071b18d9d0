"""``n`` choices as ``n`` engine requests: ids and seeds as vLLM's parallel sampling gives them,
chunks tagged with their choice, the stream ending when every child has, closing it aborting
every child, and a child's failure failing the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from prefixmesh.replica.engines.base import EngineChunk, EngineRequest
from prefixmesh.replica.engines.choices import child_request, choice_chunks
from prefixmesh.wire import SamplingSettings


class Children:
    """An engine whose every request yields ``tokens`` chunks, then finishes (or fails)."""

    def __init__(self, tokens: int = 3, fail: str | None = None, forever: bool = False) -> None:
        self.tokens = tokens
        self.fail = fail
        self.forever = forever
        self.started: list[EngineRequest] = []
        self.closed: list[str] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.started.append(request)
        try:
            for step in range(self.tokens):
                await asyncio.sleep(0)
                if request.request_id == self.fail and step == 1:
                    raise RuntimeError("engine died")
                yield EngineChunk((step,), finished=step == self.tokens - 1, finish_reason=None)
            while self.forever:
                await asyncio.sleep(0.01)
                yield EngineChunk((9,))
        finally:
            self.closed.append(request.request_id)


def request(n: int, seed: int | None = 5) -> EngineRequest:
    return EngineRequest("r", (1, 2, 3), SamplingSettings(max_tokens=3, n=n, seed=seed))


def test_children_have_their_own_ids_and_seeds_as_vllm_s() -> None:
    child = child_request(request(4), 2)
    assert (child.request_id, child.sampling.n, child.sampling.seed) == ("r-2", 1, 7)
    assert child.prompt_token_ids == (1, 2, 3)
    assert child_request(request(4, seed=None), 3).sampling.seed is None
    top = EngineRequest("r", (1,), SamplingSettings(max_tokens=1, n=3, seed=2**64 - 2))
    assert [child_request(top, i).sampling.seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]


async def test_one_choice_is_the_engine_s_own_request() -> None:
    engine = Children()
    chunks = [chunk async for chunk in choice_chunks(engine.generate, request(1))]
    assert [r.request_id for r in engine.started] == ["r"]
    assert [chunk.index for chunk in chunks] == [0, 0, 0]


async def test_every_choice_streams_tagged_and_the_stream_ends_with_the_last() -> None:
    engine = Children()
    chunks = [chunk async for chunk in choice_chunks(engine.generate, request(3))]
    assert sorted(r.request_id for r in engine.started) == ["r-0", "r-1", "r-2"]
    for index in range(3):
        mine = [chunk for chunk in chunks if chunk.index == index]
        assert [chunk.token_ids for chunk in mine] == [(0,), (1,), (2,)]
        assert mine[-1].finished
    assert sorted(engine.closed) == ["r-0", "r-1", "r-2"]


async def test_closing_the_stream_aborts_every_child() -> None:
    engine = Children(tokens=1, forever=True)
    stream = choice_chunks(engine.generate, request(2))
    assert (await stream.__anext__()).token_ids == (0,)
    await stream.aclose()  # type: ignore[attr-defined]
    assert sorted(engine.closed) == ["r-0", "r-1"]


async def test_a_failed_child_fails_the_request_and_stops_the_others() -> None:
    engine = Children(tokens=3, fail="r-1", forever=True)
    with pytest.raises(RuntimeError, match="engine died"):
        async for _ in choice_chunks(engine.generate, request(3)):
            pass
    assert sorted(engine.closed) == ["r-0", "r-1", "r-2"]
