"""The contract suite runs every test against both backends: in-process and a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher, CacheFingerprint
from prefixmesh.cache_registry.memory import InMemoryRegistry, RegistryState
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.loadtest.local_redis import LocalRedisServer
from tests.fakes.clock import FakeClock

BLOCK = 4
HASHER = BlockHasher(BLOCK, "contract-model")

RegistryFactory = Callable[..., CacheRegistry]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
async def make_registry(
    request: pytest.FixtureRequest, clock: FakeClock
) -> AsyncIterator[RegistryFactory]:
    """Builds clients that share one registry (one store, or one Redis namespace)."""
    clients: list[CacheRegistry] = []
    states: dict[tuple[object, ...], RegistryState] = {}
    namespace = f"test-{uuid.uuid4().hex[:12]}"

    def factory(fingerprint: CacheFingerprint = HASHER.fingerprint, **kwargs: Any) -> CacheRegistry:
        kwargs.setdefault("clock", clock)
        client: CacheRegistry
        if request.param == "memory":
            # One state per distinct setting, as one Redis holds one namespace's settings.
            settings = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
            state = states.get(settings)
            if state is None:
                state = states[settings] = RegistryState(**kwargs)
            client = InMemoryRegistry(fingerprint, state)
        else:
            server: LocalRedisServer = request.getfixturevalue("redis_server")
            client = RedisRegistry(fingerprint, server.url, namespace=namespace, **kwargs)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()
