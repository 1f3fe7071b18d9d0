"""What the KV connector counts, carried the way vLLM carries any connector's telemetry.

The connector runs inside vLLM's engine-core and worker processes, where no metric of ours
can be exported. vLLM gives each connector a path out: ``get_kv_connector_stats`` (scheduler
and worker side) returns a ``KVConnectorStats`` with the counts since the last call; vLLM adds
the workers' and the scheduler's together and hands the dict to every stat logger of the
frontend process, where ``build_prom_metrics`` turns it into Prometheus series (through Ray's
metrics agent inside a Serve replica, labelled with its ``ReplicaId``) and the replica's own
logger keeps the running totals for its report.

Counts (``COUNTERS``) add up; ``shared_tier_usable`` is a state (the last report wins): 0 once
either side found the shared folder unusable (unwritable, full, unreadable).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

_Metric = TypeVar("_Metric", Counter, Gauge)

COUNTERS: dict[str, str] = {
    "cpu_loads": "Blocks loaded from the CPU tier",
    "disk_loads": "Blocks loaded from the disk tier",
    "shared_loads": "Blocks loaded from the cluster's shared tier",
    "cpu_stores": "Blocks written to the CPU tier",
    "disk_stores": "Blocks written to the disk tier",
    "shares": "Blocks written to the shared tier",
    "moves": "Blocks moved from the CPU tier down to disk",
    "drops": "Blocks dropped from a lower tier",
    "rejected": "Computed blocks the policy admitted to no tier",
    "loads_declined": "Blocks held below but recomputed (loading was not faster)",
    "async_loads": "Requests whose blocks were loaded beside the engine's steps",
    "layer_loads": "Requests whose CPU-tier blocks were loaded inside their step, layer by layer",
    "write_errors": "Tier files that could not be written (a full or unwritable disk)",
    "shared_scan_errors": "Listings of the shared folder that failed",
    "outside_waits": "Requests the replica held before the engine, told to the lookahead",
    "prefetched": "Blocks promoted from disk into the CPU tier ahead of a waiting request",
    "prefetch_failed": "Blocks whose promotion ahead of a waiting request failed",
}
USABLE = "shared_tier_usable"
STATES: dict[str, str] = {
    USABLE: "1 while the shared tier is in use, 0 once its folder proved unusable",
}
METRIC_PREFIX = "prefixmesh:kv_connector_"


@dataclass
class PrefixmeshConnectorStats(KVConnectorStats):
    """Counts since the last report, and states, by name (``COUNTERS``, ``STATES``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PrefixmeshConnectorStats:
        return PrefixmeshConnectorStats(merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def merge(into: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """``into`` with ``more`` added: counts summed; a state is the lowest (unusable wins)."""
    merged = dict(into)
    for name, value in more.items():
        if name in STATES:
            merged[name] = min(merged.get(name, value), value)
        else:
            merged[name] = merged.get(name, 0) + value
    return merged


def counts_since(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The counts that moved since ``before`` (only those: an idle step reports nothing)."""
    return {name: value - before.get(name, 0) for name, value in now.items()
            if value != before.get(name, 0)}  # fmt: skip


def _per_engine(metric: _Metric, labelvalues: dict[int, list[object]]) -> dict[int, _Metric]:
    """vLLM's ``create_metric_per_engine``, keeping the metric's kind: its child per engine."""
    return {index: metric.labels(*values) for index, values in labelvalues.items()}


def _unregister_ours() -> None:
    """Forget the series an earlier engine of this process registered with prometheus_client
    (a second engine would otherwise fail on duplicates; vLLM does the same for its own,
    ``unregister_vllm_metrics``). Ray's metrics are not in this registry."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(METRIC_PREFIX):
            REGISTRY.unregister(collector)


class PrefixmeshPromMetrics(KVConnectorPromMetrics):
    """One counter per ``COUNTERS`` entry and a gauge per state, labelled as vLLM's own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()
        # vLLM's classes for each kind (prometheus_client's, or Ray's with the same methods).
        counter: Callable[..., Counter] = metric_types[Counter]
        gauge: Callable[..., Gauge] = metric_types[Gauge]
        self._counters = {
            name: _per_engine(
                counter(name=METRIC_PREFIX + name, documentation=text, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, text in COUNTERS.items()
        }
        self._states = {
            name: _per_engine(
                gauge(
                    name=METRIC_PREFIX + name,
                    documentation=text,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, text in STATES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value > 0:
                self._counters[name][engine_idx].inc(value)
            elif name in self._states:
                self._states[name][engine_idx].set(value)
