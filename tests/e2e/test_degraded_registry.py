"""A registry that cannot be reached degrades routing; it never fails a request."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.ports import free_port
from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(ray_cluster: Cluster, deploy: Deploy) -> Iterator[Cluster]:
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    deploy(
        PROXY_PATH,
        "replica.engine=sim",
        "replica.num_replicas=2",
        "registry.backend=redis",
        f"registry.redis_url={nothing_listens}",
    )
    yield ray_cluster


def test_requests_succeed_with_the_registry_down(cluster: Cluster) -> None:
    for i in range(6):
        response = httpx.post(
            f"{cluster.base_url}/v1/completions",
            timeout=60,
            # Long enough to have full blocks: a prompt shorter than a block needs no lookup.
            json={"model": "demo-tiny", "prompt": f"hello {i} " * 200, "max_tokens": 3},
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=30).text
    fallbacks = {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "prefixmesh_routing_fallbacks_total"
    }
    assert fallbacks["error"] == 0  # no decision raised: degraded, not crashed
    assert fallbacks["registry_unavailable"] > 0  # routed without the registry
