"""Ray's metrics agent as a ``MetricSink``: one Prometheus endpoint per node for every process.

Each Ray node runs a metrics agent that serves the ``ray.util.metrics`` values of every worker
on that node at ``http://<node>:<metrics export port>/metrics`` (``ray_`` before each name; Ray
adds ``WorkerId``, ``NodeAddress`` and others). Our series also carry the Serve replica that
recorded them (``PROCESS_LABELS``): sums across processes are right, and a replica's series
join vLLM's, which carry the same ``ReplicaId``. Values reach the agent every
``metrics_report_interval_ms`` (10 s by default).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixmesh.metrics.sink import NullSink

if TYPE_CHECKING:
    from prefixmesh.metrics.sink import (
        CounterInstrument,
        GaugeInstrument,
        HistogramInstrument,
        MetricSink,
    )
    from prefixmesh.metrics.spec import CounterSpec, GaugeSpec, HistogramSpec

PROCESS_LABELS = ("application", "deployment", "ReplicaId")
"""Which process recorded a series: its Serve application and deployment (as Ray Serve's own
metrics name them) and its replica (as vLLM's ``RayPrometheusStatLogger`` names it)."""


def process_tags(application: str, deployment: str, replica: str) -> dict[str, str]:
    return dict(zip(PROCESS_LABELS, (application, deployment, replica), strict=True))


class _RayInstrument:
    """A ``ray.util.metrics`` metric bound to label values (none until ``labels``)."""

    __slots__ = ("_metric", "_tags")

    def __init__(self, metric: Any, tags: dict[str, str] | None = None) -> None:
        self._metric = metric
        self._tags = tags

    def labels(self, **values: str) -> _RayInstrument:
        return _RayInstrument(self._metric, {k: str(v) for k, v in values.items()})

    def inc(self, amount: float = 1) -> None:
        if amount:  # Ray refuses an increment of 0 (prometheus_client takes it)
            self._metric.inc(amount, tags=self._tags)

    def set(self, value: float) -> None:
        self._metric.set(value, tags=self._tags)

    def observe(self, amount: float) -> None:
        self._metric.observe(amount, tags=self._tags)

    def remove(self, *values: str) -> None:
        """Ray cannot drop a series: the last value stays until the process ends."""
        return None


class RaySink:
    """``ray.util.metrics`` with ``tags`` (the process's labels) on every series."""

    def __init__(self, tags: Mapping[str, str]) -> None:
        self._tags = dict(tags)

    def _keys(self, labels: tuple[str, ...]) -> tuple[str, ...]:
        return (*labels, *self._tags)

    def counter(self, spec: CounterSpec) -> CounterInstrument:
        from ray.util.metrics import Counter

        metric = Counter(spec.name, spec.help, tag_keys=self._keys(spec.labels))
        return _RayInstrument(metric.set_default_tags(self._tags))

    def gauge(self, spec: GaugeSpec) -> GaugeInstrument:
        from ray.util.metrics import Gauge

        metric = Gauge(spec.name, spec.help, tag_keys=self._keys(spec.labels))
        return _RayInstrument(metric.set_default_tags(self._tags))

    def histogram(self, spec: HistogramSpec) -> HistogramInstrument:
        from ray.util.metrics import Histogram

        # Ray takes positive bounds only; a 0 bucket (no matched blocks) has its own series.
        bounds = [b for b in spec.buckets if b > 0]
        metric = Histogram(spec.name, spec.help, bounds, tag_keys=self._keys(spec.labels))
        return _RayInstrument(metric.set_default_tags(self._tags))


def serve_replica_sink() -> MetricSink:
    """Ray's agent, labelled with this Serve replica, when called inside one; a ``NullSink``
    anywhere else (tests, CLIs, a driver), where no agent gathers the values."""
    ray = sys.modules.get("ray")  # not imported: not a Ray worker (and no import just to ask)
    if ray is None or not ray.is_initialized():
        return NullSink()
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:
        return NullSink()
    return RaySink(process_tags(context.app_name, context.deployment, context.replica_tag))


def node_metrics_urls() -> list[str]:
    """Every live node's metrics endpoint (call from a connected driver)."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in nodes
        if node["Alive"]
    ]
