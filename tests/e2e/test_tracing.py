"""Tracing on the real cluster (sim, one replica, ``telemetry.tracing=memory``), on both serving
paths: a request's spans form one trace that continues the client's ``traceparent``.

Proxy path: client -> ``prefixmesh.request`` (ingress) -> ``prefixmesh.route`` -> the replica's
spans, across the Serve handle call. Direct path: client -> ``prefixmesh.router.request``
(HAProxy's routing call; HAProxy hands the router the client's header under Serve's session
header) -> ``prefixmesh.route`` -> the replica's spans, through the router's ticket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from prefixmesh.app import INGRESS_NAME, REPLICA_NAME, ROUTER_NAME
from prefixmesh.config import PrefixmeshConfig
from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
DOCUMENT = " ".join(f"clause {i}: the party of the {i}th part shall comply." for i in range(120))
CLIENT_SPAN = "b7ad6b7169203331"
REPLICA_SPANS = {
    "prefixmesh.replica.generate",
    "prefixmesh.replica.queue",
    "prefixmesh.replica.prefill",
    "prefixmesh.replica.decode",
}


@dataclass(frozen=True)
class ServingPath:
    override: str
    front: str
    """The deployment that makes the request's first span."""
    front_span: str
    role: str


PATHS = {
    "proxy": ServingPath(PROXY_PATH, INGRESS_NAME, "prefixmesh.request", "ingress"),
    "direct": ServingPath(
        "serving.path=direct", ROUTER_NAME, "prefixmesh.router.request", "router"
    ),
}


@dataclass(frozen=True)
class Traced:
    cluster: Cluster
    config: PrefixmeshConfig
    path: ServingPath


@pytest.fixture(scope="module", params=sorted(PATHS))
def traced(
    request: pytest.FixtureRequest, ray_cluster: Cluster, deploy: Deploy
) -> Iterator[Traced]:
    path = PATHS[request.param]
    config = deploy(
        path.override, "replica.engine=sim", "replica.num_replicas=1", "telemetry.tracing=memory"
    )
    if path.front == ROUTER_NAME:
        _await_the_router_s_first_decision(ray_cluster, config)
    yield Traced(ray_cluster, config, path)


def _handle(config: PrefixmeshConfig, name: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(name, config.app_name)


def _await_the_router_s_first_decision(cluster: Cluster, config: PrefixmeshConfig) -> None:
    """The router's first calls may come before its handle knows the replica (a blind pick,
    no decision span): the tests start once it decides."""
    router = _handle(config, ROUTER_NAME)
    deadline = time.monotonic() + 60
    while router.counts.remote().result(timeout_s=30)["routed"] < 1:
        assert time.monotonic() < deadline, "the router made no decision"
        body = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
        httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60)
        time.sleep(0.1)


def _traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-01"


def _front_spans(traced: Traced) -> list[dict[str, Any]]:
    if traced.path.front == INGRESS_NAME:
        return list(httpx.get(f"{traced.cluster.base_url}/admin/traces", timeout=30).json())
    # On the direct path GETs go to the replicas: ask the router through its handle.
    return list(_handle(traced.config, ROUTER_NAME).traces.remote().result(timeout_s=30))


def _spans_of(trace_id: str, traced: Traced) -> dict[str, dict[str, Any]]:
    """The trace's spans by name from the front process and the replica's, once the replica's
    four are in (they end just after the response)."""
    replica = _handle(traced.config, REPLICA_NAME)
    wanted = REPLICA_SPANS | {traced.path.front_span, "prefixmesh.route"}
    deadline = time.monotonic() + 20
    while True:
        exported = replica.exported_spans.remote().result(timeout_s=30)
        spans = [s for s in _front_spans(traced) + exported if s["trace_id"] == trace_id]
        names = {s["name"] for s in spans}
        if wanted <= names:
            return _by_name(spans)
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


def test_one_trace_from_the_client_to_the_replica(traced: Traced) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client = openai.OpenAI(
        base_url=f"{traced.cluster.base_url}/v1", api_key="unused", max_retries=0
    )
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=DOCUMENT,
        max_tokens=4,
        extra_headers={"traceparent": _traceparent(trace_id)},
    )
    assert raw.parse().usage is not None
    spans = _spans_of(trace_id, traced)

    front, route = spans[traced.path.front_span], spans["prefixmesh.route"]
    generate = spans["prefixmesh.replica.generate"]
    assert front["parent_span_id"] == CLIENT_SPAN  # the client's span
    assert route["parent_span_id"] == front["span_id"]
    assert generate["parent_span_id"] == route["span_id"]  # across the handle call or ticket
    for phase in ("queue", "prefill", "decode"):
        assert spans[f"prefixmesh.replica.{phase}"]["parent_span_id"] == generate["span_id"]
    assert front["role"] == route["role"] == traced.path.role
    assert generate["role"] == "replica"
    assert generate["links"] == []  # one trace: nothing to link

    replica = raw.headers["x-prefixmesh-replica"]
    assert route["attributes"]["prefixmesh.policy"] == traced.config.routing.policy
    assert route["attributes"]["prefixmesh.replica"] == replica
    assert generate["attributes"]["prefixmesh.replica"] == replica
    assert front["attributes"]["prefixmesh.replica"] == replica
    assert generate["attributes"]["prefixmesh.output_tokens"] == 4
    assert [e["name"] for e in spans["prefixmesh.replica.prefill"]["events"]] == ["first_token"]


def test_a_repeated_prefix_is_traced_as_a_hit_and_a_stream_ends_its_span(
    traced: Traced,
) -> None:
    _complete(traced.cluster, "11111111111111111111111111111111")
    time.sleep(0.3)  # the replica's cache events reach the registry
    trace_id = "22222222222222222222222222222222"
    response = _complete(traced.cluster, trace_id, stream=True)
    assert response.text.rstrip().endswith("data: [DONE]")
    spans = _spans_of(trace_id, traced)

    route = spans["prefixmesh.route"]["attributes"]
    assert route["prefixmesh.matched_blocks"] >= 1
    assert route["prefixmesh.tier"] == "GPU"
    assert route["prefixmesh.registry_outcome"] == "ok"
    generate = spans["prefixmesh.replica.generate"]["attributes"]
    assert generate["prefixmesh.cached_tokens"] >= 128
    assert generate["prefixmesh.finish_reason"] == "length"
    front = spans[traced.path.front_span]
    if traced.path.front == INGRESS_NAME:  # the ingress's span lasts as long as the stream
        assert front["attributes"]["prefixmesh.stream"] is True
        assert front["end_ns"] >= spans["prefixmesh.replica.prefill"]["end_ns"]
    else:  # the router's lasts as long as its routing call
        assert front["attributes"]["prefixmesh.prompt_tokens"] >= 128
