"""The cluster on Ray Serve in front of replica servers (``replica.engine: remote``): our router
sees the remote engines' caches through their forwarded events, and Ray's own routers
(``routing.serve_request_router``) run on the same app."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from prefixmesh.loadtest.peers import ManagedProcess, wait_http
from prefixmesh.ports import free_port
from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
DOCUMENT = " ".join(f"clause {i}: the party of the {i}th part shall comply." for i in range(120))


@pytest.fixture(scope="module")
def replica_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    ports = [free_port(), free_port()]

    def command(i: int, port: int) -> list[str]:
        return [
            sys.executable, "-m", "prefixmesh.cli", "replica-server", "--engine", "sim",
            "--port", str(port), "--replica-id", f"r{i}",
        ]  # fmt: skip

    processes = [
        ManagedProcess(
            f"replica-{i}", command(i, port), logs / f"replica-{i}.log", {"HF_HUB_OFFLINE": "1"}
        )
        for i, port in enumerate(ports)
    ]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, process in zip(urls, processes, strict=True):
            wait_http(f"{url}/health", 120, process)
        yield urls
    finally:
        for process in processes:
            process.stop()


def remote(urls: list[str], *extra: str) -> tuple[str, ...]:
    return (
        "replica.engine=remote",
        "replica.num_replicas=2",
        "cache.block_size=128",  # the sim replica servers'
        f"replica.remote.urls=[{', '.join(urls)}]",
        "replica.routing_stats_period_s=0.5",
        *extra,
    )


def complete(cluster: Cluster, prompt: str) -> httpx.Response:
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def served_by(urls: list[str]) -> list[int]:
    counts = []
    for url in urls:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        counts += [
            int(float(line.split()[-1]))
            for line in lines
            if line.startswith("prefixmesh_replica_requests_total")
        ]
    return counts


def test_our_router_follows_the_remote_caches(
    ray_cluster: Cluster, deploy: Deploy, replica_servers: list[str]
) -> None:
    deploy(PROXY_PATH, *remote(replica_servers))
    before = served_by(replica_servers)
    first = complete(ray_cluster, DOCUMENT + " Question 0?")
    holder = first.headers["x-prefixmesh-replica"]
    time.sleep(0.5)  # the stored event travels replica server -> Serve replica -> registry
    for i in range(1, 5):
        response = complete(ray_cluster, DOCUMENT + f" Question {i}?")
        assert response.headers["x-prefixmesh-replica"] == holder
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    after = served_by(replica_servers)
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 5]


@pytest.mark.parametrize("router", ["ray_pow2", "ray_prefix_affinity"])
def test_rays_own_routers_run_on_the_same_app(
    ray_cluster: Cluster, deploy: Deploy, replica_servers: list[str], router: str
) -> None:
    deploy(PROXY_PATH, *remote(replica_servers, f"routing.serve_request_router={router}"))
    document = DOCUMENT.replace("party", router)
    replicas = [
        complete(ray_cluster, document + f" Q{i}?").headers["x-prefixmesh-replica"]
        for i in range(6)
    ]
    assert all(replicas)
    if router == "ray_prefix_affinity":  # it reads the prompt from GenerateRequest.prompt
        assert len(set(replicas[1:])) == 1
