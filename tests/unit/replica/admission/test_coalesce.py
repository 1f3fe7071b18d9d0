"""Stream coalescing: the first delta alone, later ones merged while the consumer is busy,
errors and early closes passed through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from prefixmesh.replica.admission.coalesce import coalesced, merge_chunks
from prefixmesh.replica.engines.base import EngineChunk


def test_merging_keeps_token_order_and_the_end_state() -> None:
    merged = merge_chunks(
        [
            EngineChunk((1,), num_cached_tokens=128),
            EngineChunk((2, 3)),
            EngineChunk((4,), True, "length"),
        ]
    )
    assert merged == EngineChunk((1, 2, 3, 4), True, "length", 128)
    one = EngineChunk((9,))
    assert merge_chunks([one]) is one


async def _steps(count: int, gate: asyncio.Event | None = None) -> AsyncIterator[EngineChunk]:
    for i in range(count):
        if i == 1 and gate is not None:
            await gate.wait()
        yield EngineChunk((i,), i == count - 1, "length" if i == count - 1 else None)
        await asyncio.sleep(0)


async def test_a_fast_consumer_gets_every_delta_and_a_slow_one_gets_them_merged() -> None:
    fast = [c async for c in coalesced(_steps(5))]
    assert [t for c in fast for t in c.token_ids] == [0, 1, 2, 3, 4] and fast[-1].finished

    gate = asyncio.Event()
    stream = coalesced(_steps(6, gate))
    first = await stream.__anext__()
    assert first.token_ids == (0,)  # the first delta is not held back for company
    gate.set()
    await asyncio.sleep(0.05)  # a consumer busy elsewhere while the engine steps on
    rest = [c async for c in stream]
    assert len(rest) == 1 and rest[0] == EngineChunk((1, 2, 3, 4, 5), True, "length", 0)


async def test_an_engine_error_arrives_after_the_deltas_before_it() -> None:
    async def failing() -> AsyncIterator[EngineChunk]:
        yield EngineChunk((1,))
        yield EngineChunk((2,))
        raise RuntimeError("engine died")

    stream = coalesced(failing())
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="engine died"):
        async for chunk in stream:
            seen.extend(chunk.token_ids)
    assert seen == [1, 2]


async def test_closing_the_stream_closes_the_engine_side() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[EngineChunk]:
        try:
            while True:
                yield EngineChunk((7,))
                await asyncio.sleep(0.001)
        finally:
            closed.set()  # where the vLLM and remote engines abort the request

    stream = coalesced(endless())
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.wait_for(closed.wait(), 1.0)
