"""What the tenant checks cost (issue 17's targets), for ``tenant-bench --checks``:

- ``time_checks``: the API-key check and a quota admission plus its settlement, as a request
  makes them, sequential, in process: with the in-process store and with a Redis on loopback;
- ``time_big_body``: a 10 MB body's refusal (413) through the cluster's front door.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from prefixmesh.api.auth import ApiKeys
from prefixmesh.api.quota import MemoryQuotaStore, QuotaStore, TenantQuotas
from prefixmesh.api.request_metrics import RequestMetrics
from prefixmesh.cache_registry.redis_quota import RedisQuotaStore
from prefixmesh.config import PrefixmeshConfig, QuotasConfig, TenantQuota
from prefixmesh.loadtest.local_redis import LocalRedisServer

TEN_MB = 10_000_000


def _p50_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 4)


async def _time_store(keys: ApiKeys, store: QuotaStore, samples: int) -> dict[str, float]:
    limits = QuotasConfig(default=TenantQuota(tokens_per_minute=10**12, concurrent_requests=10**6))
    quotas = TenantQuotas(limits, store, 60.0, RequestMetrics(cluster=None))
    headers = {"authorization": "Bearer sk-bench-light"}
    auth, admit, settle = [], [], []
    for i in range(samples + 20):  # the first ones warm the connection and the script cache
        t0 = time.perf_counter()
        tenant = keys.check(headers)
        t1 = time.perf_counter()
        slot = await quotas.admit(tenant, f"r{i}", 1000)
        t2 = time.perf_counter()
        await quotas.settle(slot, 4)
        t3 = time.perf_counter()
        if i >= 20:
            auth.append(t1 - t0)
            admit.append(t2 - t1)
            settle.append(t3 - t2)
    await quotas.close()
    return {
        "auth_p50_ms": _p50_ms(auth),
        "admit_p50_ms": _p50_ms(admit),
        "settle_p50_ms": _p50_ms(settle),
        "on_request_path_p50_ms": _p50_ms([a + b for a, b in zip(auth, admit, strict=True)]),
    }


def time_checks(samples: int, keys_file: Path, redis: LocalRedisServer) -> dict[str, Any]:
    keys = ApiKeys(keys_file, ("/health", "/metrics"), 60.0)

    async def both() -> dict[str, Any]:
        memory = await _time_store(keys, MemoryQuotaStore(), samples)
        in_redis = await _time_store(keys, RedisQuotaStore(redis.endpoint(), "bench", 1.0), samples)
        return {"samples": samples, "memory": memory, "redis": in_redis}

    return asyncio.run(both())


def time_big_body(config: PrefixmeshConfig, url: str, samples: int) -> dict[str, Any]:
    """Milliseconds from sending a 10 MB completion body to its 413 (the body is sent whole:
    the time includes the upload over loopback)."""
    import httpx
    from ray import serve

    from prefixmesh.app import build_app

    body = b'{"model": "%s", "prompt": "' % config.model.encode() + b"x" * TEN_MB + b'"}'
    headers = {"Authorization": "Bearer sk-bench-light", "Content-Type": "application/json"}
    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    times, statuses = [], []
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(samples + 1):
                started = time.perf_counter()
                response = client.post("/v1/completions", content=body, headers=headers)
                times.append(time.perf_counter() - started)
                statuses.append(response.status_code)
    finally:
        serve.delete(config.app_name)
    return {
        "samples": samples,
        "statuses": sorted(set(statuses)),
        "p50_ms": _p50_ms(times[1:]),
        "max_ms": round(max(times[1:]) * 1000, 2),
    }
