"""Replicas' publishers on a real Redis: an idle replica heals a restarted registry, and a
replica killed while idle is reaped by the live ones within 5 s (issue 6), with the default
liveness settings."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.types import EventKind, ReplicaId, Tier
from prefixmesh.config import RegistryConfig
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.replica.engines.base import BlockChange, Residency
from prefixmesh.replica.events.publisher import EventPublisher
from tests.integration.cache_registry.conftest import HASHER

pytestmark = [pytest.mark.redis, pytest.mark.slow]
KEY = HASHER.hash_tokens(list(range(32)))
H = KEY.block_hashes
DEFAULTS = RegistryConfig()


@pytest.fixture
def server() -> Iterator[LocalRedisServer]:
    with LocalRedisServer() as private:
        yield private


@pytest.fixture
async def client(server: LocalRedisServer) -> AsyncIterator[Callable[[], RedisRegistry]]:
    namespace = f"live-{uuid.uuid4().hex[:8]}"
    clients: list[RedisRegistry] = []

    def make() -> RedisRegistry:
        registry = RedisRegistry(
            HASHER.fingerprint, server.url, namespace=namespace, op_timeout_s=0.1
        )
        clients.append(registry)
        return registry

    yield make
    for registry in clients:
        await registry.close()


async def replica(
    name: str, registry: RedisRegistry, blocks: tuple[int, ...], **kwargs: float
) -> EventPublisher:
    await registry.connect()
    publisher = EventPublisher(
        ReplicaId(name),
        registry,
        lambda: Residency.of({Tier.GPU: blocks}),  # type: ignore[dict-item]
        heartbeat_s=kwargs.get("heartbeat_s", DEFAULTS.heartbeat_interval_s),
        liveness=registry,
        reap_interval_s=kwargs.get("reap_interval_s", DEFAULTS.reap_interval_s),
        dead_after_s=kwargs.get("dead_after_s", DEFAULTS.dead_after_s),
    )
    publisher.submit([BlockChange(EventKind.STORED, Tier.GPU, blocks)])  # type: ignore[arg-type]
    publisher.start()
    return publisher


async def wait_until(check: Callable[[], object], timeout_s: float) -> float:
    started = time.monotonic()
    while not await check():  # type: ignore[misc]
        assert time.monotonic() - started < timeout_s, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_a_replica_killed_while_idle_leaves_within_5_s(
    client: Callable[[], RedisRegistry],
) -> None:
    probe = client()
    await probe.connect()
    a = await replica("a", client(), H)
    b = await replica("b", client(), H[:4])
    try:
        await wait_until(lambda: _holders(probe, {"a": 8, "b": 4}), 5)
        # Both idle long enough that only heartbeats keep them (and B has been in contact for
        # dead_after_s, so it reaps).
        await asyncio.sleep(DEFAULTS.dead_after_s + 0.5)
        assert await probe.known_replicas() == {"a", "b"}

        await a.stop()  # killed: no flush, no drop, no more heartbeats
        took_s = await wait_until(lambda: _holders(probe, {"b": 4}), 5.0)
        assert took_s <= 5.0
        assert await probe.known_replicas() == {"b"}
        assert b.reaped == 1 and b.resyncs == 0
    finally:
        await a.stop()
        await b.stop()


async def _holders(probe: RedisRegistry, expected: dict[str, int]) -> bool:
    hits = await probe.lookup(KEY, [], deadline_s=0.5)
    return {r: h.num_blocks for r, h in hits.items()} == expected


async def test_an_idle_replica_heals_after_a_restart(
    server: LocalRedisServer, client: Callable[[], RedisRegistry]
) -> None:
    probe = client()
    await probe.connect()
    a = await replica("a", client(), H[:3])
    try:
        await wait_until(lambda: _holders(probe, {"a": 3}), 5)
        server.restart()  # empty: the replica's entries and its sequence are gone
        took_s = await wait_until(lambda: _holders(probe, {"a": 3}), 5)
        assert took_s <= 3.0
        assert a.resyncs == 1 and a.heartbeat_mismatches == 1
    finally:
        await a.stop()
