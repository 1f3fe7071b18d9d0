"""Token quotas in a real Redis (issue 17): the script decides exactly as the in-process store
on the same sequence of requests, two servers share one tenant's count, and a Redis that is
gone lets requests in (counted) within the store's time budget."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator

import pytest

from prefixmesh.api.errors import APIError
from prefixmesh.api.quota import MemoryQuotaStore, TenantQuotas
from prefixmesh.cache_registry.quota_rules import MINUTE_MS, QuotaAsk
from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.cache_registry.redis_quota import RedisQuotaStore
from prefixmesh.config import QuotasConfig, TenantQuota
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.ports import free_port
from tests.unit.api.test_quota import Recorded

pytestmark = pytest.mark.redis
T0 = 29_000_000 * MINUTE_MS


@pytest.fixture
async def stores(redis_server: LocalRedisServer) -> AsyncIterator[list[RedisQuotaStore]]:
    namespace = f"quota-{uuid.uuid4().hex[:8]}"
    made = [RedisQuotaStore(redis_server.endpoint(), namespace, 2.0) for _ in range(2)]
    yield made
    for store in made:
        await store.close()


async def test_the_script_decides_as_the_in_process_store(
    stores: list[RedisQuotaStore],
) -> None:
    redis_store, memory = stores[0], MemoryQuotaStore()
    rng = random.Random(17)
    now = T0 + 123
    running: list[tuple[str, str]] = []
    decided: list[str] = []
    for i in range(600):
        now += rng.choice((0, 7, 250, 1_500, 9_000, 45_000))
        tenant = rng.choice(("a", "b"))
        window_ms = (10_000, 60_000)[i % 2]
        if running and rng.random() < 0.4:
            who, request_id = running.pop(rng.randrange(len(running)))
            tokens = rng.randrange(0, 300)
            await redis_store.settle(who, request_id, tokens, now, window_ms)
            await memory.settle(who, request_id, tokens, now, window_ms)
            continue
        request_id, tokens = f"r{i}", rng.randrange(1, 700)
        limits = (1_000, 3) if tenant == "a" else (2_500, 0)
        ask = QuotaAsk(tenant, request_id, tokens, now, *limits, 30_000, window_ms)
        in_redis = await redis_store.admit(ask)
        in_memory = await memory.admit(ask)
        assert in_redis == in_memory, (i, ask)
        decided.append(in_redis.limit or "admitted")
        if in_redis.admitted:
            running.append((tenant, request_id))
    # The sequence went through every branch.
    assert {"admitted", "tokens", "concurrency"} <= set(decided)


async def test_two_servers_share_one_tenant_s_minute(stores: list[RedisQuotaStore]) -> None:
    limits = QuotasConfig(window_s=60, default=TenantQuota(tokens_per_minute=100))
    first, second = (TenantQuotas(limits, s, 60.0, Recorded()) for s in stores)
    await first.admit("team-a", "r1", 60)
    with pytest.raises(APIError) as raised:
        await second.admit("team-a", "r2", 60)
    assert raised.value.status == 429 and "Used 60" in raised.value.message
    await second.admit("team-a", "r3", 40)


async def test_a_redis_that_is_gone_lets_requests_in_and_counts_it() -> None:
    nothing_listens = RedisEndpoint(f"redis://127.0.0.1:{free_port()}/0")
    store = RedisQuotaStore(nothing_listens, "quota-gone", 0.2)
    metrics = Recorded()
    limits = QuotasConfig(default=TenantQuota(tokens_per_minute=10))
    gate = TenantQuotas(limits, store, 60.0, metrics)
    try:
        slot = await gate.admit("team-a", "r1", 1_000)
        await gate.settle(slot, 1)
    finally:
        await gate.close()
    assert metrics.store_errors == 2
