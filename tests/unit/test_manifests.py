from __future__ import annotations

from pathlib import Path

import pytest

from prefixmesh.config import PrefixmeshConfig, load_config

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


@pytest.mark.parametrize("path", sorted(MANIFESTS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_manifest_loads(path: Path) -> None:
    assert isinstance(load_config(path), PrefixmeshConfig)


def test_local_manifest_is_the_embedded_default() -> None:
    assert load_config(MANIFESTS / "local.yaml") == PrefixmeshConfig()
