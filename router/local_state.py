"""State the ingress shares with Ray Serve's copy of our request router in the same process.

Serve builds the request router itself (from a pickled class) inside the ingress replica's
process, and runs it on its own event loop thread; the ingress cannot hand it objects. The two
meet here, by application name: the in-process registry (single-ingress mode), the load ledger,
the router's metrics and the router itself (whose replicas carry their latest stats). This
module is imported by reference in both, so it is the process-wide rendezvous; every access
goes through the lock (the metrics excepted: they lock themselves).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.router.ledger import LoadLedger
from prefixmesh.router.metrics import RouterMetrics


@dataclass
class LocalRouterState:
    registry: RegistryState
    ledger: LoadLedger = field(default_factory=LoadLedger)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    """The router's Prometheus metrics (thread-safe on their own; no lock needed)."""
    stats_source: Any = None
    """The request router, whose replicas carry their latest reported stats."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    _applied_reports: dict[str, object] = field(default_factory=dict)
    """Per replica, the ``seen_requests`` list last applied to the ledger (held, so that a new
    report's list can never be mistaken for it by identity)."""

    def apply_reports(
        self, reports: Iterable[tuple[str, Mapping[str, Any]]], now_s: float, expiry_s: float
    ) -> None:
        """The direct path's load accounting (caller holds the lock): drop the ledger entries
        the replicas' reports list as seen, each report once (Serve replaces a replica's stats
        object when a new report arrives), and expire entries no report ever listed."""
        for replica, stats in reports:
            seen = stats.get("seen_requests")
            if seen is None or self._applied_reports.get(replica) is seen:
                continue
            self._applied_reports[replica] = seen
            self.ledger.seen(seen)
        self.ledger.expire(now_s, expiry_s)

    def replica_stats(self) -> list[dict[str, Any]]:
        """Every replica's latest ``record_routing_stats`` report (polled by Serve)."""
        with self.lock:
            source = self.stats_source
        if source is None:
            return []
        replicas = list(source.curr_replicas.values())
        return [{"replica_id": r.replica_id.unique_id, **(r.routing_stats or {})} for r in replicas]


_STATES: dict[str, LocalRouterState] = {}
_STATES_LOCK = threading.Lock()


def local_state(
    app_name: str, registry_factory: Callable[[], RegistryState] = RegistryState
) -> LocalRouterState:
    """The one state of ``app_name`` in this process, created on first use."""
    with _STATES_LOCK:
        state = _STATES.get(app_name)
        if state is None:
            state = _STATES[app_name] = LocalRouterState(registry_factory())
        return state
