"""What each metric is: its kind, name, help, labels and buckets (pure values, no client).

A spec turns into an instrument through a ``MetricSink`` (``spec.build(sink)``), so one list of
specs serves a process's own ``/metrics`` text and Ray's metrics agent alike. The names a scraper
sees follow from the spec: ``sample_names`` (prometheus_client's exposition) and, through Ray's
agent, the same with ``ray_`` in front (``ray_names``). The dashboard test checks its queries
against these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixmesh.metrics.sink import (
        CounterInstrument,
        GaugeInstrument,
        HistogramInstrument,
        MetricSink,
    )

RAY_PREFIX = "ray_"
"""Ray's metrics agent exports every ``ray.util.metrics`` metric under this namespace."""


@dataclass(frozen=True, slots=True)
class CounterSpec:
    name: str
    help: str
    labels: tuple[str, ...] = ()

    def build(self, sink: MetricSink) -> CounterInstrument:
        return sink.counter(self)

    def sample_names(self) -> tuple[str, ...]:
        return (f"{self.name}_total",)


@dataclass(frozen=True, slots=True)
class GaugeSpec:
    name: str
    help: str
    labels: tuple[str, ...] = ()

    def build(self, sink: MetricSink) -> GaugeInstrument:
        return sink.gauge(self)

    def sample_names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    name: str
    help: str
    buckets: tuple[float, ...]
    labels: tuple[str, ...] = ()

    def build(self, sink: MetricSink) -> HistogramInstrument:
        return sink.histogram(self)

    def sample_names(self) -> tuple[str, ...]:
        return tuple(f"{self.name}_{suffix}" for suffix in ("bucket", "sum", "count"))


MetricSpec = CounterSpec | GaugeSpec | HistogramSpec


def ray_names(spec: MetricSpec) -> tuple[str, ...]:
    """The sample names Ray's agent exports for ``spec``: ``ray_`` in front, and characters
    OpenTelemetry refuses (vLLM's ``:``) as ``_``."""
    return tuple(RAY_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", n) for n in spec.sample_names())
