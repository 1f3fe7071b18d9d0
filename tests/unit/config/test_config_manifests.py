"""Every config manifest, and the ``--set`` overrides the docs and scripts use, resolve to the
same config as before ``prefixmesh/config.py`` became a package (issue 37): the fixture is
``model_dump(mode="json")`` of each case under the old code at 777570c.

Regenerate (only for a deliberate change of the config's meaning) by running this file with a
checkout's interpreter: ``python tests/unit/config/test_config_manifests.py >
tests/unit/config/fixtures/config_dumps.json``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefixmesh.config import PrefixmeshConfig, load_config, merge_overrides

ROOT = Path(__file__).resolve().parents[3]
MANIFESTS = ROOT / "manifests"
FIXTURE = Path(__file__).parent / "fixtures" / "config_dumps.json"

OVERRIDES: dict[str, list[str]] = {
    "engine-sim": ["replica.engine=sim"],
    "engine-sim-block-16": ["replica.engine=sim", "cache.block_size=16"],
    "block-null": ["cache.block_size=null"],
    "cache-null": ["cache=null"],
    "engine-remote": [
        "replica.engine=remote",
        "replica.num_replicas=1",
        "replica.remote.urls=[http://127.0.0.1:9100]",
    ],
    "redis-tls": [
        "registry.backend=redis",
        "registry.redis_url=rediss://redis.example:6380/0",
        "registry.redis_tls_ca_file=/etc/ca.pem",
        "serving.routers_per_node=2",
    ],
    "quotas": [
        "quotas.default.tokens_per_minute=600",
        "quotas.tenants={a: {concurrent_requests: 2}}",
    ],
    "kvcache-adaptive": ["kvcache.policy=adaptive", "kvcache.cpu_tier_gib=1.5"],
}


def _app_configs(serve_config: dict[str, Any]) -> Iterator[tuple[int, Callable[[], Any]]]:
    for index, app in enumerate(serve_config["applications"]):
        args = app.get("args") or {}
        settings = merge_overrides(args.get("settings") or {}, args.get("overrides") or [])
        path = ROOT / args["config"] if args.get("config") else None
        yield index, lambda path=path, settings=settings: load_config(path, settings, environ={})


def cases() -> dict[str, Callable[[], Any]]:
    """Each case's name and how it loads (hermetic: no process environment)."""
    found: dict[str, Callable[[], Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found[path.name] = lambda path=path: load_config(path, environ={})
        for name, overrides in OVERRIDES.items():
            found[f"{path.name} --set {name}"] = lambda path=path, o=overrides: load_config(
                path, o, environ={}
            )
    for path in sorted((MANIFESTS / "serve").glob("*.yaml")):
        for index, load in _app_configs(yaml.safe_load(path.read_text())):
            found[f"serve/{path.name}[{index}]"] = load
    for doc in yaml.safe_load_all((MANIFESTS / "kuberay" / "rayservice.yaml").read_text()):
        if doc and doc.get("kind") == "RayService":
            serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
            for index, load in _app_configs(serve_config):
                found[f"kuberay/rayservice.yaml[{index}]"] = load
    return found


def _dump(load: Callable[[], Any]) -> Any:
    config = load()
    assert isinstance(config, PrefixmeshConfig)
    return config.model_dump(mode="json")


def test_the_fixture_covers_every_case() -> None:
    assert sorted(json.loads(FIXTURE.read_text())) == sorted(cases())


@pytest.mark.parametrize("name", sorted(cases()))
def test_each_case_resolves_as_before(name: str) -> None:
    expected = json.loads(FIXTURE.read_text())[name]
    assert _dump(cases()[name]) == expected


def test_the_resolved_block_sizes_are_pinned() -> None:
    """The values the fixture's cases turn on, spelled out: the engine's block size when unset."""
    sizes = {
        name: dump["cache"]["block_size"] for name, dump in json.loads(FIXTURE.read_text()).items()
    }
    assert sizes["local.yaml"] == 32
    assert sizes["sim.yaml"] == 128
    assert sizes["local.yaml --set engine-sim"] == 128
    assert sizes["sim.yaml --set block-null"] == 128
    assert sizes["local.yaml --set engine-sim-block-16"] == 16
    assert sizes["local.yaml --set engine-remote"] == 32
    assert sizes["local.yaml --set cache-null"] == 32


if __name__ == "__main__":
    json.dump({name: _dump(load) for name, load in cases().items()}, sys.stdout, indent=1)
    sys.stdout.write("\n")
