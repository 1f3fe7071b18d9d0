"""The KV connector's counts on their way out of vLLM's processes: summed across reports and
sides, a state kept at its worst, and exported as Prometheus series."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from prefixmesh.replica.kvcache.connector_stats import (
    METRIC_PREFIX,
    USABLE,
    PrefixmeshConnectorStats,
    PrefixmeshPromMetrics,
    counts_since,
    merge,
)


def test_only_the_counts_that_moved_are_reported() -> None:
    before = {"cpu_loads": 4, "disk_loads": 2}
    assert counts_since({"cpu_loads": 4, "disk_loads": 5, "shares": 1}, before) == {
        "disk_loads": 3,
        "shares": 1,
    }
    assert counts_since(before, before) == {}


def test_counts_add_up_and_an_unusable_shared_tier_stays_unusable() -> None:
    scheduler = PrefixmeshConnectorStats({"cpu_loads": 3, USABLE: 1})
    worker = PrefixmeshConnectorStats({"write_errors": 2, USABLE: 0})
    total = scheduler.aggregate(worker).aggregate(PrefixmeshConnectorStats({"cpu_loads": 1}))
    assert total.reduce() == {"cpu_loads": 4, "write_errors": 2, USABLE: 0}
    assert merge({USABLE: 0}, {USABLE: 1}) == {USABLE: 0}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and total.reduce() == {}


def test_the_counts_become_prometheus_series_per_engine() -> None:
    labels = ["model_name", "engine"]
    config = SimpleNamespace(kv_transfer_config=None)
    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    for _ in range(2):  # a second engine in one process registers them again
        metrics = PrefixmeshPromMetrics(config, types, labels, {0: ["demo", "0"]})
    metrics.observe({"disk_loads": 80, "shares": 0, USABLE: 1})
    metrics.observe({"disk_loads": 8, USABLE: 0, "unknown": 5})
    tags = {"model_name": "demo", "engine": "0"}
    assert REGISTRY.get_sample_value(METRIC_PREFIX + "disk_loads_total", tags) == 88
    assert REGISTRY.get_sample_value(METRIC_PREFIX + "shares_total", tags) == 0
    assert REGISTRY.get_sample_value(METRIC_PREFIX + USABLE, tags) == 0
