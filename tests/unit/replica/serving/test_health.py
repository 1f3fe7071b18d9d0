"""A replica whose engine cannot serve fails Serve's health check (Serve then replaces it), and
a replica that leaves for good takes its registry entries with it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.cache_registry.memory import InMemoryRegistry
from prefixmesh.cache_registry.types import EventKind, ReplicaId, Tier
from prefixmesh.replica.engines.base import BlockChange, EngineLoad, Residency
from prefixmesh.replica.engines.remote_engine import (
    RemoteEngine,
    RemoteEngineSettings,
    encode_load,
)
from prefixmesh.replica.engines.vllm_engine import VllmEngine, VllmEngineSettings
from prefixmesh.replica.events.publisher import EventPublisher
from prefixmesh.replica.serving.deployment import ReplicaCore
from tests.fakes.front_door import prepared_only
from tests.unit.replica.conftest import eventually, sim_config

R = ReplicaId("replica-a")
HASHER = make_hasher(sim_config())
KEY = HASHER.hash_tokens(list(range(3 * 128)))


class _Engine:
    def __init__(self, healthy: bool) -> None:
        self.is_healthy = healthy
        self.shut_down = False

    def healthy(self) -> bool:
        return self.is_healthy

    async def shutdown(self) -> None:
        self.shut_down = True

    def close(self) -> None:
        pass


def _server(
    engine: _Engine, publisher: Any = None, registry: InMemoryRegistry | None = None
) -> ReplicaCore:
    """The replica's core, no Serve (``publisher``: a fake when the calls touch none)."""
    return ReplicaCore(
        sim_config(),
        R,
        engine,  # type: ignore[arg-type]
        publisher or SimpleNamespace(),
        registry=registry,
    )


async def test_check_health_raises_when_the_engine_is_not_healthy() -> None:
    engine = _Engine(healthy=True)
    server = _server(engine)
    await server.check_health()
    engine.is_healthy = False
    with pytest.raises(RuntimeError, match="not healthy"):
        await server.check_health()


def test_a_vllm_engine_is_healthy_until_it_errors() -> None:
    settings = VllmEngineSettings("model", 128, 4096, 2**30, True, 1, None)
    engine = VllmEngine(settings, HASHER, lambda _: None)
    assert not engine.healthy()  # not started
    engine._engine = SimpleNamespace(errored=False)
    assert engine.healthy()
    engine._engine = SimpleNamespace(errored=True)  # AsyncLLM: the engine core died
    assert not engine.healthy()


async def test_a_remote_engine_is_unhealthy_once_its_server_is_gone_too_long() -> None:
    """On the engine's own clock (a fake one here), from what its event stream carried: a
    loaded machine that delays the stream cannot change the outcome (it once did)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    up = {"up": True}
    refused = {"count": 0}
    line = json.dumps({"load": encode_load(EngineLoad())}).encode() + b"\n"

    async def events(request: web.Request) -> web.StreamResponse:
        """The replica server's event stream: a load line every 20 ms, until it goes."""
        response = web.StreamResponse()
        if not up["up"]:
            refused["count"] += 1
            request.transport.close()  # type: ignore[union-attr]
            return response
        await response.prepare(request)
        while up["up"]:
            await response.write(line)
            await asyncio.sleep(0.02)
        request.transport.close()  # type: ignore[union-attr]
        return response

    app = web.Application()
    app.router.add_get("/engine/events", events)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    settings = RemoteEngineSettings(
        str(server.make_url("")).rstrip("/"), reconnect_interval_s=0.02, unhealthy_after_s=0.3
    )
    now = {"s": 0.0}
    engine = RemoteEngine(settings, HASHER, lambda _: None, clock=lambda: now["s"])
    engine._session = engine._open_session()
    engine._events_task = asyncio.get_running_loop().create_task(engine._follow_events())
    try:
        now["s"] = 10.0  # long past unhealthy_after_s, but the stream was heard all along
        await eventually(lambda: engine._last_heard == 10.0, 20)  # a line heard at 10 s
        assert engine.healthy()
        up["up"] = False
        # Once a reconnection was refused, the old stream is over: nothing more is heard.
        await eventually(lambda: refused["count"] >= 1, 20)
        now["s"] = 10.2
        assert engine.healthy()  # a restart on the same port is not a death
        now["s"] = 10.4
        assert not engine.healthy()
        up["up"] = True
        await eventually(lambda: engine._last_heard == 10.4, 20)  # heard again
        assert engine.healthy()
    finally:
        await engine.shutdown()
        await server.close()


async def test_shutdown_drops_the_replica_from_a_shared_registry() -> None:
    registry = InMemoryRegistry(HASHER.fingerprint)
    engine = _Engine(healthy=True)
    publisher = EventPublisher(
        R, registry, lambda: Residency.of({Tier.GPU: KEY.block_hashes}), liveness=registry
    )
    server = _server(engine, publisher, registry)
    server.publisher.start()
    server.publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, KEY.block_hashes)])
    await server.shutdown()  # the final flush delivers the change, then the drop removes it
    assert await registry.lookup(KEY, [R], deadline_s=1.0) == {}
    assert await registry.known_replicas() == set()
    assert registry.state.dropped.keys() == {R} and engine.shut_down


def test_health_through_the_front_door_says_why_the_registry_is_degraded() -> None:
    """On the direct path ``GET /health`` reaches a replica: it reports what its own registry
    client saw (here another cluster's fingerprint), not a blind "ok"."""
    from prefixmesh.cache_registry.redis_registry import RedisRegistry
    from prefixmesh.replica.serving.direct_front import DirectFront

    in_process = DirectFront(_server(_Engine(healthy=True)), prepared_only(), str)
    assert in_process.health() == {"status": "ok"}
    registry = RedisRegistry(HASHER.fingerprint, "redis://127.0.0.1:9/0")
    registry._disabled_reason = "the registry holds another cluster's blocks"
    replica = _server(_Engine(healthy=True), registry=registry)  # type: ignore[arg-type]
    body = DirectFront(replica, prepared_only(), str).health()
    assert body["status"] == "degraded" and body["code"] == "fingerprint"
