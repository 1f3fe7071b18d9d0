"""The real cluster with sim replicas: local Ray, the OpenAI client, routing you can see."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy, published_events, wait_published

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
DOCUMENT = " ".join(f"clause {i}: the party of the {i}th part shall comply." for i in range(120))


@pytest.fixture(scope="module")
def cluster(ray_cluster: Cluster, deploy: Deploy) -> Iterator[Cluster]:
    deploy(
        PROXY_PATH,
        "replica.engine=sim",
        "replica.num_replicas=4",
        "replica.max_ongoing_requests=64",
    )
    yield ray_cluster


def complete(cluster: Cluster, prompt: str, max_tokens: int = 2) -> httpx.Response:
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
    )
    assert response.status_code == 200, response.text
    return response


def test_openai_client_streaming_and_not(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)
    response = client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert response.usage is not None and response.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_shared_prefix_requests_land_on_the_holder(cluster: Cluster) -> None:
    before = published_events(front="Ingress")
    first = complete(cluster, DOCUMENT + " Question 0?")
    holder = first.headers["x-prefixmesh-replica"]
    wait_published(holder, before, front="Ingress")  # its cache events reach the registry
    for i in range(1, 6):
        response = complete(cluster, DOCUMENT + f" Question {i}?")
        assert response.headers["x-prefixmesh-replica"] == holder
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_metrics_endpoint(cluster: Cluster) -> None:
    complete(cluster, "metrics please")
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=30).text
    assert "prefixmesh_ttft_seconds_bucket" in text
    assert "prefixmesh_routing_decisions_total" in text
    assert 'prefixmesh_requests_total{status="200"}' in text
