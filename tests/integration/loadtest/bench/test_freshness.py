"""The freshness benchmark end to end: a replica process publishing to a real Redis, this one
polling it like a router."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.loadtest.bench.freshness import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_every_store_and_eviction_becomes_visible_and_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "freshness.json"
    args = ["--replicas", "2", "--changes", "12", "--rate", "40", "--keep", "4"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["missed"] == 0
    # A lag is at least one publish batch away and, on loopback, well under a second.
    for measure in ("store", "evict"):
        assert 0 < result[f"{measure}_p50_ms"] <= result[f"{measure}_p99_ms"] < 1000
