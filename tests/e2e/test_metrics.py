"""One Prometheus view of the cluster: Ray's metrics agent serves the router's and every
replica's metrics on one port per node, each series labelled with the Serve replica that
recorded it, so the per-process series sum to what the cluster did."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
APP = "pm-metrics"


def labelled(text: str, name: str, **match: str) -> dict[str, float]:
    """``name``'s samples whose labels include ``match``, summed by ``ReplicaId``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == name and all(labels.get(k) == v for k, v in match.items()):
                out[labels["ReplicaId"]] = out.get(labels["ReplicaId"], 0.0) + sample.value
    return out


def labelled_all(text: str, name: str) -> list[float]:
    """Every sample of ``name`` in a process's own text (no process labels there)."""
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def test_the_agent_shows_the_router_and_each_replica_summing_to_what_was_sent(
    ray_cluster: Cluster, deploy: Deploy
) -> None:
    from ray import serve

    from prefixmesh.api.render import REPLICA_HEADER
    from prefixmesh.app import REPLICA_NAME, ROUTER_NAME
    from prefixmesh.local_ray import haproxy_metrics_url
    from prefixmesh.metrics.ray_sink import node_metrics_urls

    deploy(f"app_name={APP}", "replica.engine=sim", "replica.num_replicas=2")
    router = serve.get_deployment_handle(ROUTER_NAME, APP)

    def post(i: int) -> str:
        body = {"model": MODEL, "prompt": f"metrics {i} " * 40, "max_tokens": 32}
        response = httpx.post(f"{ray_cluster.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    # Until the router decides (its first calls may come before it knows the replicas), then
    # concurrent batches until both replicas have served: a loaded replica is avoided.
    served: Counter[str] = Counter()
    for i in range(100):
        served[post(i)] += 1
        if router.counts.remote().result()["routed"] >= 1:
            break
    with ThreadPoolExecutor(4) as pool:
        for batch in range(1, 11):
            if len(served) == 2:
                break
            served.update(pool.map(post, range(1000 * batch, 1000 * batch + 4)))
    assert len(served) == 2, served
    own = router.router_metrics.remote().result()  # the router's own /metrics text
    decisions = sum(labelled_all(own, "prefixmesh_routing_decisions_total"))
    assert decisions >= 1

    # Ray's agent receives the values every report interval (10 s): poll, bounded.
    (url,) = node_metrics_urls()
    deadline = time.monotonic() + 40
    while True:
        text = httpx.get(url, timeout=10).text
        replicas = labelled(
            text,
            "ray_prefixmesh_requests_total",
            application=APP,
            deployment=REPLICA_NAME,
            status="200",
        )
        routers = labelled(text, "ray_prefixmesh_routing_decisions_total", application=APP)
        if replicas == dict(served) and sum(routers.values()) == decisions:
            break
        assert time.monotonic() < deadline, (replicas, dict(served), routers, decisions)
        time.sleep(1)
    # Three processes, three labels: one router (it decided every routed request), two replicas.
    assert len(routers) == 1 and not set(routers) & set(replicas)
    ttft = labelled(text, "ray_prefixmesh_ttft_seconds_count", application=APP)
    assert ttft == dict(served)  # every request's first token, on the replica that served it
    # HAProxy's own exporter (docs/metrics.md): its frontend counts the requests too. Ray
    # reloads HAProxy whenever its routes change, and a reload starts the counters over, so
    # the count is read around a few more requests, again (bounded) if it went down meanwhile.
    haproxy = haproxy_metrics_url()
    assert haproxy is not None

    def frontend_requests() -> int:
        text = httpx.get(haproxy, timeout=10).text
        return int(sum(labelled_all(text, "haproxy_frontend_http_requests_total")))

    counted: list[tuple[int, int]] = []
    for attempt in range(3):
        first = frontend_requests()
        for i in range(4):
            post(2000 + 10 * attempt + i)
        counted.append((first, frontend_requests()))
        if counted[-1][1] >= first:
            break
    first, last = counted[-1]
    assert last - first >= 4, counted
