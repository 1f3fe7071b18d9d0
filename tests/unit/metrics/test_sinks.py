"""Metric specs go to every sink alike: a process's own text, the cluster's view (Ray's agent,
labelled per process), or nowhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.api.request_metrics import DIRECT_METRICS, REQUEST_METRICS, DirectMetrics
from prefixmesh.local_ray import SERVICE_DISCOVERY_FILE, write_service_discovery
from prefixmesh.metrics.ray_sink import PROCESS_LABELS, RaySink, process_tags, serve_replica_sink
from prefixmesh.metrics.sink import NullSink, PrometheusSink, Tee
from prefixmesh.metrics.spec import CounterSpec, GaugeSpec, HistogramSpec, MetricSpec, ray_names
from prefixmesh.metrics.vllm_export import cluster_stat_loggers
from prefixmesh.router.core.metrics import ROUTER_METRICS, RouterMetrics

COUNTER = CounterSpec("pm_test_requests", "Requests", ("status",))
GAUGE = GaugeSpec("pm_test_load", "Load", ("replica", "field"))
HISTOGRAM = HistogramSpec("pm_test_blocks", "Blocks", (0, 1, 4), ("tier",))


class Recording:
    """A sink that keeps every call: (metric name, label values, operation, value)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[tuple[str, str], ...], str, float]] = []
        self.built: list[MetricSpec] = []

    def _make(self, spec: MetricSpec) -> Any:
        self.built.append(spec)
        return _Recorded(self, spec.name, ())

    counter = gauge = histogram = _make


class _Recorded:
    def __init__(self, sink: Recording, name: str, labels: tuple[tuple[str, str], ...]) -> None:
        self.sink, self.name, self.bound = sink, name, labels

    def labels(self, **values: str) -> _Recorded:
        return _Recorded(self.sink, self.name, tuple(sorted(values.items())))

    def inc(self, amount: float = 1) -> None:
        self.sink.calls.append((self.name, self.bound, "inc", amount))

    def set(self, value: float) -> None:
        self.sink.calls.append((self.name, self.bound, "set", value))

    def observe(self, amount: float) -> None:
        self.sink.calls.append((self.name, self.bound, "observe", amount))

    def remove(self, *values: str) -> None:
        self.sink.calls.append(
            (self.name, tuple((str(i), v) for i, v in enumerate(values)), "remove", 0)
        )


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_tee_sends_every_value_to_each_sink() -> None:
    local, cluster = PrometheusSink(), Recording()
    sink = Tee(local, cluster)
    counter, gauge, histogram = COUNTER.build(sink), GAUGE.build(sink), HISTOGRAM.build(sink)
    counter.labels(status="200").inc()
    counter.labels(status="200").inc(2)
    gauge.labels(replica="r1", field="running").set(3)
    histogram.labels(tier="gpu").observe(2)
    gauge.remove("r1", "running")

    got = samples(local.render())
    assert got[("pm_test_requests_total", (("status", "200"),))] == 3
    assert ("pm_test_load", (("field", "running"), ("replica", "r1"))) not in got
    assert got[("pm_test_blocks_bucket", (("le", "4.0"), ("tier", "gpu")))] == 1
    assert cluster.built == [COUNTER, GAUGE, HISTOGRAM]
    assert cluster.calls == [
        ("pm_test_requests", (("status", "200"),), "inc", 1),
        ("pm_test_requests", (("status", "200"),), "inc", 2),
        ("pm_test_load", (("field", "running"), ("replica", "r1")), "set", 3),
        ("pm_test_blocks", (("tier", "gpu"),), "observe", 2),
        ("pm_test_load", (("0", "r1"), ("1", "running")), "remove", 0),
    ]


def test_the_router_and_the_replica_record_into_the_cluster_sink_too() -> None:
    cluster = Recording()
    router = RouterMetrics(cluster)
    router.decided("prefixmesh", "hit", 6, "gpu", hold=True, seconds=0.001)
    router.saw_load("r1", queued=2, running=3, pending_tokens=100)
    replica = DirectMetrics(cluster)
    replica.error(413)
    replica.unrouted.inc()

    assert {s.name for s in cluster.built} == {
        s.name for s in (*ROUTER_METRICS, *REQUEST_METRICS, *DIRECT_METRICS)
    }
    assert (
        "prefixmesh_routing_decisions",
        (("policy", "prefixmesh"), ("reason", "hit")),
        "inc",
        1,
    ) in cluster.calls
    assert ("prefixmesh_routing_matched_blocks", (("tier", "gpu"),), "observe", 6) in cluster.calls
    assert ("prefixmesh_routing_holds", (), "inc", 1) in cluster.calls
    load = (("field", "running"), ("replica", "r1"))
    assert ("prefixmesh_replica_load", load, "set", 3) in cluster.calls
    assert ("prefixmesh_requests", (("status", "413"),), "inc", 1) in cluster.calls
    assert ("prefixmesh_unrouted_requests", (), "inc", 1) in cluster.calls
    # The process's own text is unchanged: no process labels (its target names the process).
    got = samples(replica.render())
    assert got[("prefixmesh_requests_total", (("status", "413"),))] == 1
    assert got[("prefixmesh_unrouted_requests_total", ())] == 1


def test_ray_metrics_carry_the_process_labels_and_only_positive_buckets() -> None:
    tags = process_tags("app", "Replica", "abc123")
    assert tuple(tags) == PROCESS_LABELS
    sink = RaySink(tags)
    counter, gauge, histogram = COUNTER.build(sink), GAUGE.build(sink), HISTOGRAM.build(sink)
    for instrument, spec in ((counter, COUNTER), (gauge, GAUGE), (histogram, HISTOGRAM)):
        info = instrument._metric.info  # type: ignore[attr-defined]
        assert info["name"] == spec.name
        assert info["tag_keys"] == (*spec.labels, *PROCESS_LABELS)
        assert info["default_tags"] == tags
    assert histogram._metric.boundaries == [1, 4]  # type: ignore[attr-defined]
    counter.labels(status="200").inc(0)  # Ray refuses 0; prometheus_client takes it: skipped
    counter.labels(status="200").inc()
    gauge.labels(replica="r1", field="queued").set(1)
    gauge.remove("r1", "queued")  # Ray cannot drop a series: a no-op, not an error
    histogram.labels(tier="none").observe(0)


def test_outside_a_serve_replica_the_cluster_view_gets_nothing() -> None:
    """Also in a driver that has started Ray (the e2e tests run before this one in a full
    run): only a Serve replica's process feeds the cluster view."""
    assert isinstance(serve_replica_sink(), NullSink)
    assert cluster_stat_loggers() == []  # vLLM keeps its own prometheus_client logger
    NullSink().gauge(GAUGE).labels(replica="r", field="f").set(1)


def test_ray_names_are_prefixed_and_sanitized() -> None:
    assert ray_names(COUNTER) == ("ray_pm_test_requests_total",)
    assert ray_names(GAUGE) == ("ray_pm_test_load",)
    assert ray_names(HISTOGRAM) == (
        "ray_pm_test_blocks_bucket",
        "ray_pm_test_blocks_sum",
        "ray_pm_test_blocks_count",
    )
    assert ray_names(GaugeSpec("vllm:kv_cache_usage_perc", "")) == ("ray_vllm_kv_cache_usage_perc",)


def test_service_discovery_lists_the_agents_as_ray_writes_them(tmp_path: Path) -> None:
    path = write_service_discovery(tmp_path, ["127.0.0.1:8080"])
    assert path == tmp_path / SERVICE_DISCOVERY_FILE
    assert json.loads(path.read_text()) == [
        {"labels": {"job": "ray"}, "targets": ["127.0.0.1:8080"]}
    ]
    write_service_discovery(tmp_path, ["127.0.0.1:9090"])  # replaced whole, nothing left over
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:9090"]
    assert [p.name for p in tmp_path.iterdir()] == [SERVICE_DISCOVERY_FILE]


def test_a_driver_that_started_ray_feeds_no_engine_metrics_to_the_cluster_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a full run failed the test above because the e2e tests had started Ray in
    the test process; only an actor (a Serve replica) exports vLLM's metrics through Ray."""
    import types

    context = types.SimpleNamespace(get_actor_id=lambda: None)
    driver = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", driver)
    assert cluster_stat_loggers() == []
