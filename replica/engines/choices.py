"""A request for ``n`` choices as ``n`` engine requests, their chunks interleaved.

vLLM serves ``n`` > 1 the same way (its parallel sampling fans a parent request out into ``n``
children under ids of their own, the child's seed ``seed + index``): the children share the
prompt, so the prefix cache computes it once and the others hit it. Doing it here, above the
``Engine`` protocol, serves ``n`` on every engine alike. Each chunk carries its choice's
``index``; the stream ends when every child has, and closing it aborts every child.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

from prefixmesh.replica.engines.base import EngineChunk, EngineRequest

Generate = Callable[[EngineRequest], AsyncIterator[EngineChunk]]
SEED_LIMIT = 2**64
"""The front door's bound on ``seed`` (``api/protocol.py``): a child's stays below it."""


def child_request(request: EngineRequest, index: int) -> EngineRequest:
    """Choice ``index`` of ``request``: its own id, one choice, the seed offset by the index."""
    sampling = request.sampling
    seed = None if sampling.seed is None else sampling.seed + index
    if seed is not None and seed >= SEED_LIMIT:  # vLLM takes 64-bit seeds: wrap around
        seed -= SEED_LIMIT
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-{index}",
        sampling=dataclasses.replace(sampling, n=1, seed=seed),
    )


async def choice_chunks(generate: Generate, request: EngineRequest) -> AsyncIterator[EngineChunk]:
    """``generate``'s chunks for every choice of ``request``, each with its ``index``."""
    n = request.sampling.n
    if n <= 1:
        async for chunk in generate(request):
            yield chunk
        return
    queue: asyncio.Queue[tuple[int, EngineChunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for chunk in generate(child_request(request, index)):
                queue.put_nowait((index, dataclasses.replace(chunk, index=index)))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(pump(index)) for index in range(n)]
    running = n
    try:
        while running:
            _, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # closes the child's engine stream, which aborts it there
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
