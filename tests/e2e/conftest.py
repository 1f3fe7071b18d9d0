"""A local Ray cluster on 127.0.0.1 for the end-to-end tests, owned by the test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from prefixmesh.cache_registry.redis_server import free_port
from prefixmesh.config import PrefixmeshConfig, ServingConfig, load_config
from prefixmesh.local_ray import init_local_ray


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
