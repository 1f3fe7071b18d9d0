"""Redis registry: a replica that goes silent while idle (hung: alive to Ray, so no router hears
of it) is reaped by the live replicas within 5 s and heals when it wakes; a replica killed
while idle leaves the registry within 5 s of its death (issue 6)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from prefixmesh.loadtest.local_redis import LocalRedisServer
from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedisServer() as server:
        yield server.url


def fill_caches(cluster: Cluster) -> None:
    for i in range(4):
        prompt = f"document {i}: " + " ".join(f"clause {j} of part {i}." for j in range(60))
        response = httpx.post(
            f"{cluster.base_url}/v1/completions",
            timeout=60,
            json={"model": "demo-tiny", "prompt": prompt, "max_tokens": 1},
        )
        assert response.status_code == 200, response.text


def wait_for(check: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def replica_stats(cluster: Cluster, replica: str) -> dict[str, Any]:
    stats = httpx.get(f"{cluster.base_url}/admin/replicas", timeout=10).json()
    [mine] = [s for s in stats if s["replica_id"] == replica]
    return dict(mine)


def test_a_silent_or_killed_replica_leaves_the_redis_registry(
    ray_cluster: Cluster, deploy: Deploy, redis_url: str
) -> None:
    import ray
    import redis

    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    deploy(
        PROXY_PATH,
        "replica.engine=sim",
        "replica.num_replicas=2",
        "registry.backend=redis",
        f"registry.redis_url={redis_url}",
        f"registry.namespace={namespace}",
    )
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = "{" + namespace + "}"

    def known() -> set[str]:
        return set(raw.hkeys(f"{prefix}:seq"))

    def holds(replica: str) -> int:
        return int(raw.scard(f"{prefix}:r:{replica}"))

    fill_caches(ray_cluster)
    wait_for(lambda: len(known()) == 2, 10)
    victim, survivor = sorted(known(), key=holds, reverse=True)
    assert holds(victim) > 0
    time.sleep(4.0)  # idle: only heartbeats now, and each replica has been in contact 3 s
    [name] = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(victim)
    ]
    actor = ray.get_actor(name, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    held_before = holds(victim)

    # Hung: Ray and Serve still see it (health checks take 5-15 s), no router drops it.
    os.kill(pid, signal.SIGSTOP)
    try:
        took_s = wait_for(lambda: victim not in known(), 5.0)
        assert holds(victim) == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took_s <= 5.0
    wait_for(lambda: replica_stats(ray_cluster, survivor)["reaped_replicas"] >= 1, 5)
    # Awake again: its heartbeat is out of step, so it resyncs what it holds.
    wait_for(lambda: victim in known() and holds(victim) == held_before, 5)
    assert replica_stats(ray_cluster, survivor)["resyncs"] == 0

    ray.kill(actor, no_restart=True)
    took_s = wait_for(lambda: victim not in known(), 5.0)
    assert took_s <= 5.0 and holds(victim) == 0
    raw.close()
