"""The remote engine against a live replica server (sim engine, loopback): it generates there,
mirrors what the server's engine holds from its event stream (a snapshot first), aborts there
when the caller stops reading, and refuses a server that hashes blocks differently."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.cache_registry.types import EventKind, Tier
from prefixmesh.replica.engines.base import (
    BlockChange,
    EngineChunk,
    EngineRequest,
    HeldMirror,
    Residency,
)
from prefixmesh.replica.engines.remote_engine import (
    RemoteEngine,
    RemoteEngineLost,
    RemoteEngineSettings,
    decode_changes,
    decode_chunk,
    decode_request,
    decode_residency,
    encode_changes,
    encode_chunk,
    encode_request,
    encode_residency,
    ndjson_lines,
)
from prefixmesh.wire import SamplingSettings
from tests.unit.replica.conftest import LiveServer, eventually, sim_config

PROMPT = tuple(range(3, 303))  # 300 tokens: two full blocks of 128


def test_the_wire_format_round_trips() -> None:
    request = EngineRequest("a", (5, 6), SamplingSettings(3, 0.5, 0.9, 7, (1,), True), -(2**45))
    assert decode_request(encode_request(request)) == request
    # Every sampling field travels (regression: the ones added for issue 38 were dropped).
    every = SamplingSettings(3, 0.5, 0.9, 7, (1,), False, 2, 20, 0.1, 0.5, -0.5, 1.1, 2)
    assert {f.name for f in dataclasses.fields(every)} == set(encode_request(request)["sampling"])
    sampled = EngineRequest("b", (5,), every)
    assert decode_request(encode_request(sampled)) == sampled
    hasher = make_hasher(sim_config())
    blocks = hasher.hash_tokens(PROMPT).block_hashes
    changes = [
        BlockChange(EventKind.STORED, block_hashes=blocks),
        BlockChange(EventKind.CLEARED, None),
    ]
    assert decode_changes(encode_changes(changes)) == changes
    chunk = decode_chunk({"token_ids": [1], "finished": True, "finish_reason": "length"})
    assert decode_chunk(encode_chunk(chunk)) == chunk


def test_the_mirror_follows_stores_removals_and_clears() -> None:
    mirror = HeldMirror()
    told = mirror.snapshot(Residency(((Tier.GPU, (1, 2)), (Tier.DISK, (9,)))))  # type: ignore[arg-type]
    assert [(c.kind, c.tier) for c in told] == [
        (EventKind.CLEARED, None),
        (EventKind.STORED, Tier.GPU),
        (EventKind.STORED, Tier.DISK),
    ]
    assert decode_residency(encode_residency(mirror.residency())) == mirror.residency()
    mirror.apply([BlockChange(EventKind.STORED, block_hashes=(3,))])  # type: ignore[arg-type]
    mirror.apply([BlockChange(EventKind.REMOVED, block_hashes=(1,))])  # type: ignore[arg-type]
    assert mirror.blocks() == (2, 3)
    mirror.apply([BlockChange(EventKind.CLEARED, Tier.GPU)])
    assert mirror.blocks() == () and mirror.blocks(Tier.DISK) == (9,)
    mirror.apply([BlockChange(EventKind.CLEARED, None)])
    assert mirror.residency().tiers == ()


async def test_generates_remotely_and_mirrors_the_cache(
    live_replica_server: Callable[..., LiveServer],
) -> None:
    server = live_replica_server()
    seen: list[BlockChange] = []

    def sink(changes: Sequence[BlockChange]) -> None:
        seen.extend(changes)

    hasher = make_hasher(sim_config())
    engine = RemoteEngine(RemoteEngineSettings(server.url), hasher, sink)
    await engine.start()
    try:
        capacity = engine.capacity()  # read once from the server's info, typed
        assert engine.kv_blocks == 64 and capacity is not None
        assert capacity.prefill_tokens_per_s > 0 and capacity.kv_blocks == 64
        request = EngineRequest("g1", PROMPT, SamplingSettings(max_tokens=3))
        chunks = [c async for c in engine.generate(request)]
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finished
        expected = hasher.hash_tokens(PROMPT).block_hashes
        await eventually(lambda: set(expected) <= set(engine.residency().blocks()))
        assert any(
            c.kind is EventKind.STORED and set(c.block_hashes) == set(expected) for c in seen
        )
        again = [c async for c in engine.generate(EngineRequest("g2", PROMPT, SamplingSettings(1)))]
        assert again[0].num_cached_tokens == 256
        await eventually(lambda: engine.load().prefix_cache_hit_tokens == 256)

        # stop reading mid-stream: the request is aborted in the server's engine
        long = engine.generate(EngineRequest("g3", PROMPT, SamplingSettings(max_tokens=1000)))
        await long.__anext__()
        await long.aclose()  # type: ignore[attr-defined]
        host = server.service.host  # type: ignore[attr-defined]
        await eventually(lambda: host.counters.running == 0)

        # a reset frees what no request uses (the aborted one may still hold its blocks for a
        # step), so reset until the cache is empty, as `prefixmesh compare` does
        for _ in range(100):
            assert await engine.reset_prefix_cache()
            await asyncio.sleep(0.05)
            if engine.residency().blocks() == ():
                break
        assert engine.residency().blocks() == ()
        assert any(c.kind is EventKind.REMOVED for c in seen)
    finally:
        await engine.shutdown()


async def test_a_late_subscriber_starts_from_a_snapshot(
    live_replica_server: Callable[..., LiveServer],
) -> None:
    server = live_replica_server()
    hasher = make_hasher(sim_config())
    first = RemoteEngine(RemoteEngineSettings(server.url), hasher, lambda _: None)
    await first.start()
    try:
        request = EngineRequest("s1", PROMPT, SamplingSettings(max_tokens=1))
        _ = [c async for c in first.generate(request)]
        told: list[BlockChange] = []
        late = RemoteEngine(RemoteEngineSettings(server.url), hasher, told.extend)
        await late.start()
        expected = set(hasher.hash_tokens(PROMPT).block_hashes)
        await eventually(lambda: set(late.residency().blocks()) == expected)
        assert told[0].kind is EventKind.CLEARED and set(told[1].block_hashes) == expected
        await late.shutdown()
    finally:
        await first.shutdown()


async def test_a_server_that_hashes_differently_is_refused(
    live_replica_server: Callable[..., LiveServer],
) -> None:
    server = live_replica_server()
    other = make_hasher(sim_config("cache.hash_seed=9"))
    engine = RemoteEngine(RemoteEngineSettings(server.url), other, lambda _: None)
    with pytest.raises(RuntimeError, match="hashes blocks"):
        await engine.start()
    await engine.shutdown()


async def test_an_absent_server_fails_within_the_connect_timeout() -> None:
    from prefixmesh.ports import free_port

    settings = RemoteEngineSettings(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    engine = RemoteEngine(settings, make_hasher(sim_config()), lambda _: None)
    with pytest.raises(RuntimeError, match="did not answer"):
        await engine.start()
    await engine.shutdown()


async def test_a_server_whose_capacity_cannot_be_read_is_refused() -> None:
    """Review of issue 37: an unreadable capacity failed the start before the typed
    capacity, then passed silently (routing without the replica's rates)."""
    from aiohttp import web

    fingerprint = make_hasher(sim_config()).fingerprint.to_json()

    async def info(request: Any) -> Any:
        body = {"fingerprint": fingerprint, "kv_blocks": 8, "capacity": {"kv_blocks": 8}}
        return web.json_response(body)

    async with _engine_against(info) as engine:
        with pytest.raises(RuntimeError, match="no readable capacity"):
            await engine.start()


def _dropping(request: Any) -> None:
    """Close the connection under a request, as a server closing a pooled connection does."""
    request.transport.close()


@contextlib.asynccontextmanager
async def _engine_against(handler: Callable[[Any], Awaitable[Any]]) -> AsyncIterator[RemoteEngine]:
    """A remote engine whose server is ``handler`` on a real loopback port (aiohttp's test
    server): only the server's behaviour is made up, the connection is real."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    settings = RemoteEngineSettings(str(server.make_url("")).rstrip("/"))
    engine = RemoteEngine(settings, make_hasher(sim_config()), lambda _: None)
    engine._session = engine._open_session()
    try:
        yield engine
    finally:
        await engine.shutdown()
        await server.close()


async def test_a_connection_lost_before_any_output_is_resent_once() -> None:
    # Regression: `prefixmesh compare` lost a request to a broken connection when the replica
    # server closed a pooled keep-alive connection just as the Serve replica reused it.
    from aiohttp import web

    calls: list[int] = []
    done = json.dumps(encode_chunk(EngineChunk((7,), True, "length", 0))) + "\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        if len(calls) == 1:
            _dropping(request)
        return web.Response(body=done.encode())

    request = EngineRequest("r1", PROMPT, SamplingSettings(max_tokens=1))
    async with _engine_against(handler) as engine:
        chunks = [c async for c in engine.generate(request)]
    assert len(calls) == 2 and chunks == [EngineChunk((7,), True, "length", 0)]

    calls.clear()

    async def always_failing(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        _dropping(request)
        return web.Response()

    async with _engine_against(always_failing) as engine:
        with pytest.raises(RemoteEngineLost):
            _ = [c async for c in engine.generate(request)]
    assert len(calls) == 2  # one resend, not a loop


async def test_a_connection_lost_after_output_is_not_resent() -> None:
    from aiohttp import web

    calls: list[int] = []
    first = json.dumps(encode_chunk(EngineChunk((7,), False, None, 0))).encode() + b"\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(first)
        await asyncio.sleep(0.05)
        _dropping(request)  # mid-stream, before the body's end
        return response

    request = EngineRequest("r2", PROMPT, SamplingSettings(max_tokens=5))
    seen: list[EngineChunk] = []
    async with _engine_against(handler) as engine:
        with pytest.raises(RemoteEngineLost):
            async for chunk in engine.generate(request):
                seen.append(chunk)  # noqa: PERF401 (a comprehension would lose what came before)
    assert len(calls) == 1 and seen == [EngineChunk((7,), False, None, 0)]


async def test_long_lines_are_read_whole() -> None:
    """A cache snapshot is one NDJSON line, longer than aiohttp's own line limit."""

    class Body:
        def __init__(self, chunks: list[bytes]) -> None:
            self.chunks = chunks

        async def iter_any(self) -> AsyncIterator[bytes]:
            for chunk in self.chunks:
                yield chunk

    long = b"x" * 300_000
    body = Body([b'{"a"', b":1}\n\n" + long[:100], long[100:] + b"\n{", b'"b":2}'])
    assert [line async for line in ndjson_lines(body)] == [b'{"a":1}', long, b'{"b":2}']
