"""Tracing on the real cluster (sim, one replica, ``telemetry.tracing=memory``): a request's
ingress, routing and replica spans form one trace across the Serve handle call, continuing the
client's ``traceparent``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixmesh.app import REPLICA_NAME
from prefixmesh.config import PrefixmeshConfig
from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
DOCUMENT = " ".join(f"clause {i}: the party of the {i}th part shall comply." for i in range(120))
REPLICA_SPANS = {
    "prefixmesh.replica.generate",
    "prefixmesh.replica.queue",
    "prefixmesh.replica.prefill",
    "prefixmesh.replica.decode",
}


@pytest.fixture(scope="module")
def traced(ray_cluster: Cluster, deploy: Deploy) -> Iterator[tuple[Cluster, PrefixmeshConfig]]:
    config = deploy(
        PROXY_PATH, "replica.engine=sim", "replica.num_replicas=1", "telemetry.tracing=memory"
    )
    yield ray_cluster, config


def _traceparent(trace_id: str, span_id: str = "b7ad6b7169203331") -> str:
    return f"00-{trace_id}-{span_id}-01"


def _spans_of(trace_id: str, cluster: Cluster, config: PrefixmeshConfig) -> list[dict[str, Any]]:
    """The trace's spans from the ingress process and the replica's, once the replica's four
    are in (they end just after the response)."""
    from ray import serve

    handle = serve.get_deployment_handle(REPLICA_NAME, config.app_name)
    deadline = time.monotonic() + 20
    while True:
        ingress = httpx.get(f"{cluster.base_url}/admin/traces", timeout=30).json()
        replica = handle.exported_spans.remote().result(timeout_s=30)
        spans = [s for s in ingress + replica if s["trace_id"] == trace_id]
        names = {s["name"] for s in spans}
        if REPLICA_SPANS | {"prefixmesh.request", "prefixmesh.route"} <= names:
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"spans of {trace_id}: {sorted(names)}")
        time.sleep(0.2)


def _by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for span in spans:
        assert span["name"] not in by_name, f"two {span['name']} spans"
        by_name[span["name"]] = span
    return by_name


def _complete(cluster: Cluster, trace_id: str, stream: bool = False) -> httpx.Response:
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        timeout=60,
        headers={"traceparent": _traceparent(trace_id)},
        json={"model": MODEL, "prompt": DOCUMENT, "max_tokens": 4, "stream": stream},
    )
    assert response.status_code == 200, response.text
    return response


def test_one_trace_from_the_client_to_the_replica(
    traced: tuple[Cluster, PrefixmeshConfig],
) -> None:
    cluster, config = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    response = _complete(cluster, trace_id)
    spans = _by_name(_spans_of(trace_id, cluster, config))

    request, route = spans["prefixmesh.request"], spans["prefixmesh.route"]
    generate = spans["prefixmesh.replica.generate"]
    assert request["parent_span_id"] == "b7ad6b7169203331"  # the client's span
    assert route["parent_span_id"] == request["span_id"]
    assert generate["parent_span_id"] == route["span_id"]  # across the handle call
    for phase in ("queue", "prefill", "decode"):
        assert spans[f"prefixmesh.replica.{phase}"]["parent_span_id"] == generate["span_id"]
    assert request["role"] == route["role"] == "ingress"
    assert generate["role"] == "replica"

    replica = response.headers["x-prefixmesh-replica"]
    assert route["attributes"]["prefixmesh.policy"] == config.routing.policy
    assert route["attributes"]["prefixmesh.replica"] == replica
    assert generate["attributes"]["prefixmesh.replica"] == replica
    assert request["attributes"]["prefixmesh.replica"] == replica
    assert generate["attributes"]["prefixmesh.output_tokens"] == 4
    assert [e["name"] for e in spans["prefixmesh.replica.prefill"]["events"]] == ["first_token"]


def test_a_repeated_prefix_is_traced_as_a_hit_and_a_stream_ends_its_span(
    traced: tuple[Cluster, PrefixmeshConfig],
) -> None:
    cluster, config = traced
    _complete(cluster, "11111111111111111111111111111111")
    time.sleep(0.3)  # the replica's cache events reach the registry
    trace_id = "22222222222222222222222222222222"
    response = _complete(cluster, trace_id, stream=True)
    assert response.text.rstrip().endswith("data: [DONE]")
    spans = _by_name(_spans_of(trace_id, cluster, config))

    route = spans["prefixmesh.route"]["attributes"]
    assert route["prefixmesh.matched_blocks"] >= 1
    assert route["prefixmesh.tier"] == "GPU"
    assert route["prefixmesh.registry_outcome"] == "ok"
    generate = spans["prefixmesh.replica.generate"]["attributes"]
    assert generate["prefixmesh.cached_tokens"] >= 128
    request = spans["prefixmesh.request"]
    assert request["attributes"]["prefixmesh.stream"] is True
    assert request["end_ns"] >= spans["prefixmesh.replica.prefill"]["end_ns"]
