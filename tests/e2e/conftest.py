"""A local Ray cluster on 127.0.0.1 for the end-to-end tests, owned by the test session."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from prefixmesh.config import PrefixmeshConfig, ServingConfig, load_config
from prefixmesh.local_ray import init_local_ray
from prefixmesh.ports import free_port


@dataclass(frozen=True)
class Cluster:
    base_url: str
    port: int
    cache_dir: str


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    # Short paths: Ray's unix sockets live under the temp dir and must stay under ~107 chars.
    temp_dir = tempfile.mkdtemp(prefix="pmray-", dir="/tmp")
    cache_dir = os.path.expanduser("~/.cache/prefixmesh")
    # HAProxy in front (the direct path's ingress); apps on the proxy path run behind it too.
    init_local_ray(temp_dir, num_cpus=2, serving=ServingConfig())
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield Cluster(f"http://127.0.0.1:{port}", port, cache_dir)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


Deploy = Callable[..., PrefixmeshConfig]
PROXY_PATH = "serving.path=proxy"
"""For modules that test the ingress deployment (the proxy path); the default is direct."""


@pytest.fixture(scope="module")
def deploy(ray_cluster: Cluster) -> Iterator[Deploy]:
    """Deploy the app with config overrides (one app at a time); deleted after the module."""
    from ray import serve

    from prefixmesh.app import build_app

    deployed: list[str] = []

    def _deploy(*overrides: str) -> PrefixmeshConfig:
        config = load_config(overrides=[f"cache_dir={ray_cluster.cache_dir}", *overrides])
        if config.app_name in deployed:
            # Afresh, its replicas starting side by side: redeployed in place, Serve replaces
            # them one at a time, about 3 minutes each under two busy loops (Ray's workers run
            # at niceness 15), past a test's 300 s limit.
            serve.delete(config.app_name)
        else:
            deployed.append(config.app_name)
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        return config

    yield _deploy
    for name in deployed:
        serve.delete(name)


def replica_reports(app: str = "prefixmesh", front: str = "Router") -> dict[str, dict[str, Any]]:
    """Each replica's latest report (replica id -> its wire fields), as ``app``'s front
    deployment sees it: its router on the direct path, its ingress (``"Ingress"``) on the
    proxy path."""
    from ray import serve

    stats = serve.get_deployment_handle(front, app).replica_stats.remote()
    return {s["replica_id"]: s for s in stats.result(timeout_s=30)}


def published_events(app: str = "prefixmesh", front: str = "Router") -> dict[str, int]:
    """Cache events each replica has had acknowledged by the registry, as last reported."""
    return {r: s.get("published_events", 0) for r, s in replica_reports(app, front).items()}


def wait_published(
    replica: str, before: dict[str, int], app: str = "prefixmesh", front: str = "Router"
) -> None:
    """Wait until ``replica`` reports more registry-acknowledged cache events than it did in
    ``before``: what it stored since is in the registry. Tests wait for this event instead of
    a time (under two busy loops a report or a publish can take seconds)."""
    deadline = time.monotonic() + 120  # a bound against a hang only
    while published_events(app, front).get(replica, 0) <= before.get(replica, 0):
        assert time.monotonic() < deadline, f"{replica} published nothing new"
        time.sleep(0.2)
