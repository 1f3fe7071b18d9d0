"""A replica that leaves the cluster (a redeploy replaces every replica) takes its registry
entries with it within seconds, so routers stop sending its prefixes to replicas that never saw
them (issue 6: dropped from the registry within 5 s)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def registry_replicas(cluster: Cluster) -> set[str]:
    body = httpx.get(f"{cluster.base_url}/admin/registry", timeout=10).json()
    return set(body["replicas"])


def serving_replicas(cluster: Cluster) -> set[str]:
    stats = httpx.get(f"{cluster.base_url}/admin/replicas", timeout=10).json()
    return {s["replica_id"] for s in stats}


def fill_caches(cluster: Cluster) -> None:
    for i in range(8):
        prompt = f"document {i}: " + " ".join(f"clause {j} of part {i}." for j in range(60))
        response = httpx.post(
            f"{cluster.base_url}/v1/completions",
            timeout=60,
            json={"model": "demo-tiny", "prompt": prompt, "max_tokens": 1},
        )
        assert response.status_code == 200, response.text


def wait_for(check, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_killed_replica_leaves_the_registry(ray_cluster: Cluster, deploy: Deploy) -> None:
    import ray

    deploy(
        PROXY_PATH,
        "replica.engine=sim",
        "replica.max_ongoing_requests=64",
        "replica.num_replicas=2",
    )
    fill_caches(ray_cluster)
    wait_for(lambda: len(registry_replicas(ray_cluster)) == 2, 10)
    victim = sorted(registry_replicas(ray_cluster))[0]
    [name] = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(victim)
    ]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    # Serve notices the death (health checks) and replaces the replica; from the moment its
    # routers drop it, the registry must forget it within 5 s.
    wait_for(lambda: victim not in serving_replicas(ray_cluster), 90)
    took_s = wait_for(lambda: victim not in registry_replicas(ray_cluster), 5)
    assert took_s <= 5
    fill_caches(ray_cluster)
    wait_for(lambda: registry_replicas(ray_cluster) <= serving_replicas(ray_cluster), 10)
