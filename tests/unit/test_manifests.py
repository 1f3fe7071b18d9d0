"""Every manifest is checked offline: configs load, Serve configs build the app, cluster YAMLs
pass Ray's own validation, the RayService's embedded Serve config builds too."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefixmesh.config import PrefixmeshConfig, load_config

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
CONFIGS = sorted(MANIFESTS.glob("*.yaml"))
SERVE_CONFIGS = sorted((MANIFESTS / "serve").glob("*.yaml"))
CLUSTERS = sorted((MANIFESTS / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_manifest_loads(path: Path) -> None:
    assert isinstance(load_config(path), PrefixmeshConfig)


def test_local_manifest_is_the_embedded_default() -> None:
    assert load_config(MANIFESTS / "local.yaml") == PrefixmeshConfig()


def _build(serve_config: dict[str, Any], cache_dir: Path) -> list[Any]:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    apps = []
    for app in schema.applications:
        module, _, name = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), name)
        args = dict(app.args)
        args["overrides"] = [*args.get("overrides", []), f"cache_dir={cache_dir}"]
        apps.append(builder(args))
    return apps


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_serve_config_builds_the_app(path: Path, tmp_path: Path) -> None:
    from ray.serve import Application

    apps = _build(yaml.safe_load(path.read_text()), tmp_path)
    assert apps and all(isinstance(a, Application) for a in apps)


def test_the_rayservice_serve_config_builds(tmp_path: Path) -> None:
    from ray.serve import Application

    documents = list(yaml.safe_load_all((MANIFESTS / "kuberay" / "rayservice.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "RayService")
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"
    apps = _build(yaml.safe_load(service["spec"]["serveConfigV2"]), tmp_path)
    assert all(isinstance(a, Application) for a in apps)
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service"} <= kinds  # the registry's Redis


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_cluster_yaml_passes_rays_validation(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(config))  # what `ray up` does first; raises on a violation
    commands = " ".join(config["head_start_ray_commands"])
    assert "redis-server" in commands and "prefixmesh serve" in commands
    assert "ray stop" not in commands
    assert any("prefixmesh" in c for c in config["setup_commands"])


def test_app_builder_rejects_unknown_args() -> None:
    from prefixmesh.app import app_builder

    with pytest.raises(ValueError, match="unknown app args"):
        app_builder({"confg": "typo.yaml"})
