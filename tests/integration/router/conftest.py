"""Several routing cores (one per ingress, as in a cluster) sharing one real Redis namespace, no
Ray: each has its own Redis client, ledger, policy and random seed. Fake replicas report frozen
stats (as if every report lagged), so only the routers' own accounting and the registry move."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from prefixmesh.cache_registry.factory import make_hasher, make_memory_state, make_registry
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.types import BlockHash, CacheEvent, EventKind, ReplicaId, Tier
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.router.core.decide import Candidate, RoutingCore
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.wire import GenerateRequest, ReplicaCapacity, ReplicaReport, SamplingSettings

REPLICAS = tuple(ReplicaId(f"r{i}") for i in range(4))
IDLE = ReplicaReport(capacity=ReplicaCapacity(10_000.0, 0.02, 2048, 1000))
CANDIDATES = [Candidate(r, IDLE) for r in REPLICAS]
BLOCK = 128


def document(n: int, blocks: int = 12) -> list[int]:
    """A document of ``blocks`` full blocks, different for every ``n``."""
    return [10_000 * (n + 1) + i for i in range(blocks * BLOCK)]


@dataclass
class Cluster:
    """What the routers of one test share: a Redis namespace and its config."""

    server: LocalRedisServer
    namespace: str = field(default_factory=lambda: f"mr-{uuid.uuid4().hex[:10]}")
    clients: list[CacheRegistry] = field(default_factory=list)

    def config(self, *overrides: str) -> PrefixmeshConfig:
        return load_config(
            overrides=[
                f"app_name={self.namespace}-{uuid.uuid4().hex[:6]}",
                "registry.backend=redis",
                f"registry.redis_url={self.server.url}",
                f"registry.namespace={self.namespace}",
                "ingress.num_replicas=2",  # other ingresses route too: reports are raised only
                f"cache.block_size={BLOCK}",
                *overrides,
            ]
        )

    async def client(self) -> CacheRegistry:
        registry = make_registry(self.config())
        await registry.connect()
        self.clients.append(registry)
        return registry

    async def router(self, seed: int, *overrides: str) -> RoutingCore:
        config = self.config(*overrides)
        registry = make_registry(config)
        await registry.connect()
        self.clients.append(registry)
        local = LocalRouterState(make_memory_state(config))
        return RoutingCore(config, local, rng=random.Random(seed), registry=registry)

    def request(self, tokens: list[int], question: int) -> GenerateRequest:
        ids = [*tokens, 7, question, 7, question]
        key = make_hasher(self.config()).hash_tokens(ids)
        return GenerateRequest(f"cmpl-{uuid.uuid4().hex}", tuple(ids), key, SamplingSettings(16))

    async def publish_stored(
        self, replica: ReplicaId, block_hashes: tuple[int, ...], seq: int = 0
    ) -> None:
        """``replica``'s engine stored these blocks (its own event, confirmed)."""
        blocks = tuple(BlockHash(b) for b in block_hashes)
        event = CacheEvent(EventKind.STORED, replica, 0, seq, Tier.GPU, blocks)
        [result] = await (await self.client()).publish([event])
        assert result.applied == 1, result


@pytest.fixture
async def cluster(redis_server: LocalRedisServer) -> AsyncIterator[Cluster]:
    shared = Cluster(redis_server)
    yield shared
    for client in shared.clients:
        await client.close()
