"""State the ingress shares with Ray Serve's copy of our request router in the same process.

Serve builds the request router itself (from a pickled class) inside the ingress replica's
process, and runs it on its own event loop thread; the ingress cannot hand it objects. The two
meet here, by application name: the in-process registry (single-ingress mode), the load ledger,
the router's metrics, the router itself (whose replicas carry their latest reports, as Serve's
dicts) and each routed request's ``RouteTicket`` until its caller takes it (the request
router's one channel back to the ingress and to the direct path's router). This module is
imported by reference in both, so it is the process-wide rendezvous; every access goes through
the lock (the metrics excepted: they lock themselves).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.cache_registry.types import CacheEvent, PublishResult, ReplicaId
from prefixmesh.router.core.ledger import LoadLedger
from prefixmesh.router.core.metrics import RouterMetrics
from prefixmesh.wire import ReplicaReport, RouteTicket
from prefixmesh.wire.request_progress import RequestProgress


@dataclass
class LocalRouterState:
    registry: RegistryState
    ledger: LoadLedger = field(default_factory=LoadLedger)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    """The router's Prometheus metrics (thread-safe on their own; no lock needed)."""
    stats_source: Any = None
    """The request router, whose replicas carry their latest reports (Serve's dicts)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    _reports: dict[str, tuple[object, ReplicaReport]] = field(default_factory=dict)
    """Per replica, Serve's latest report dict and its conversion (held: a dict is converted
    once, and a new one can never be mistaken for it by identity)."""
    _applied: dict[str, ReplicaReport] = field(default_factory=dict)
    """Per replica, the report last applied to the ledger."""
    _tickets: dict[str, tuple[RouteTicket, float]] = field(default_factory=dict)
    """Per request id, its latest decision and when it was recorded (oldest first)."""

    def record_ticket(self, ticket: RouteTicket, now_s: float, keep_s: float) -> None:
        """The request router decided ``ticket`` (it replaces an earlier decision for the same
        request). Tickets older than ``keep_s`` that nobody took (their caller gave up before
        the decision came) are dropped here (caller holds the lock)."""
        self._tickets.pop(ticket.request_id, None)  # re-inserted last: oldest stay first
        self._tickets[ticket.request_id] = (ticket, now_s)
        while self._tickets:
            request_id, (_, recorded_s) = next(iter(self._tickets.items()))
            if now_s - recorded_s <= keep_s:
                break
            del self._tickets[request_id]

    def take_ticket(self, request_id: str) -> RouteTicket | None:
        """The decision for ``request_id``, removed (None: not routed by a decision, e.g. a
        fallback pick; caller holds the lock)."""
        taken = self._tickets.pop(request_id, None)
        return taken[0] if taken is not None else None

    @property
    def pending_tickets(self) -> int:
        """Tickets recorded and not taken yet (caller holds the lock)."""
        return len(self._tickets)

    def report(self, replica: str, stats: Mapping[str, Any] | None) -> ReplicaReport:
        """Serve's ``routing_stats`` of ``replica`` as a ``ReplicaReport``, converted once per
        report (Serve replaces the dict when a new one arrives; caller holds the lock)."""
        cached = self._reports.get(replica)
        if cached is not None and cached[0] is stats:
            return cached[1]
        report = ReplicaReport.from_wire(stats)
        self._reports[replica] = (stats, report)
        return report

    def apply_progress(self, progress: RequestProgress) -> None:
        """The direct path with replicas that say when requests reach their first token and
        end (``PrefixmeshConfig.progress_to_router``): the ledger moves as Serve's callbacks
        move it on the proxy path (caller holds the lock)."""
        replica = ReplicaId(progress.replica)
        self.ledger.progressed(replica, progress.first_tokens, progress.finished)

    def apply_reports(
        self,
        reports: Iterable[tuple[str, ReplicaReport | Mapping[str, Any]]],
        now_s: float,
        expiry_s: float,
        *,
        progress_pushed: bool = False,
    ) -> None:
        """The direct path's load accounting (caller holds the lock): drop the ledger entries
        the replicas' reports list as seen, and those each report shows will never arrive
        (``LoadLedger.seen``), each report once, and expire entries no report ever listed. A
        report may come as its wire dict (``replica_stats``). With ``progress_pushed`` the
        replicas' progress keeps the ledger exact and reports change nothing: only entries
        whose end never came expire."""
        if progress_pushed:
            self.ledger.expire(now_s, expiry_s)
            return
        for replica, report in reports:
            if not isinstance(report, ReplicaReport):
                report = ReplicaReport.from_wire(report)
            if self._applied.get(replica) is report:
                continue
            self._applied[replica] = report
            self.ledger.seen(report.seen_requests, by=ReplicaId(replica))
        self.ledger.expire(now_s, expiry_s)

    def forget(self, replica: str) -> None:
        """A replica left: its reports go (caller holds the lock)."""
        self._reports.pop(replica, None)
        self._applied.pop(replica, None)

    def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        """The in-process registry takes replicas' cache events (it takes the lock)."""
        with self.lock:
            return self.registry.publish(events)

    def registry_replicas(self) -> list[str]:
        """The replicas the in-process registry has entries for (it takes the lock)."""
        with self.lock:
            return sorted(self.registry.sequences)

    def metrics_now(self) -> RouterMetrics:
        """The router's metrics with the ledger's requests on their way counted now (it
        takes the lock)."""
        with self.lock:
            self.metrics.ongoing.set(len(self.ledger))
        return self.metrics

    def replica_stats(self) -> list[dict[str, Any]]:
        """Every replica's latest report in its wire form, with its id (polled by Serve; for
        tests and benchmarks, through the router's handle)."""
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
