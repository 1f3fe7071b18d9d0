"""Stream coalescing: send what the engine produced since the last send as one chunk.

Every chunk a replica yields crosses Ray (a streamed object to the ingress), then becomes an SSE
event through the proxy: a few hundred microseconds of CPU per hop in Python. An engine yields a
delta per decode step for every running request, so on a busy, CPU-bound machine that relaying
competes with the engines and the routing for the same cores (Ray Serve LLM batches its streams
on a fixed 50 ms interval for the same reason). Here nothing waits on a timer: the first chunk
(the one that carries the TTFT) goes out at once, and while one send is in progress the
following deltas pile up and leave together, so batching grows only when the consumer is behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prefixmesh.replica.engines.base import EngineChunk

_DONE = object()


def merge_chunks(chunks: list[EngineChunk]) -> EngineChunk:
    """One delta for several consecutive ones: tokens in order, the end state of the last, the
    cached-token count once known."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    cached = max(chunk.num_cached_tokens for chunk in chunks)
    tokens = tuple(token for chunk in chunks for token in chunk.token_ids)
    return EngineChunk(tokens, last.finished, last.finish_reason, cached)


async def coalesced(source: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
    """``source``'s chunks, those that arrive while the consumer is busy merged into one.

    The source runs in its own task; closing this generator (a client that went away) cancels
    that task, which closes the source, so the engine aborts the request as it would have."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in source:
                queue.put_nowait(chunk)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        queue.put_nowait(_DONE)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            chunks = [item for item in items if isinstance(item, EngineChunk)]
            if chunks:
                yield merge_chunks(chunks)
            end = items[-1]
            if end is _DONE:
                return
            if isinstance(end, BaseException):
                raise end
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
