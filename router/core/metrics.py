"""Prometheus metrics of the router: its decisions, registry lookups and the load it saw.

The specs (``ROUTER_METRICS``) say what each metric is; ``RouterMetrics`` records into two sinks
at once: a prometheus_client registry of its own (two routers in one process never collide;
rendered by the router's ``/metrics``) and the cluster's view (Ray's metrics agent, labelled by
this Serve replica; nothing outside Serve). The request router runs on its own thread in the
router's process; it reaches its ``RouterMetrics`` through ``local_state`` (both sinks are
thread-safe).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prefixmesh.cache_registry.registry_health import DEGRADED_REASONS
from prefixmesh.metrics.ray_sink import serve_replica_sink
from prefixmesh.metrics.sink import MetricSink, PrometheusSink, Tee
from prefixmesh.metrics.spec import CounterSpec, GaugeSpec, HistogramSpec

if TYPE_CHECKING:
    from prefixmesh.metrics.sink import GaugeInstrument

_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Lookups have a deadline of a few ms: fine buckets below it, coarse ones for overruns.
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
FALLBACK_REASONS = ("error", "timeout", "registry_timeout", "registry_unavailable")
"""``error``: the decision raised and power of two chose; ``timeout``: a direct-path routing call
ran out of its budget and was balanced on load; ``registry_*``: the registry gave no answer in
time (or is down) and the policy routed on load alone."""
LOAD_FIELDS = ("queued", "running", "pending_prefill_tokens")

DECISIONS = CounterSpec(
    "prefixmesh_routing_decisions", "Routing decisions by policy and reason", ("policy", "reason")
)
MATCHED_BLOCKS = HistogramSpec(
    "prefixmesh_routing_matched_blocks",
    "Leading prompt blocks the chosen replica held, by the slowest tier needed",
    _BLOCK_BUCKETS,
    ("tier",),
)
LOOKUP_SECONDS = HistogramSpec(
    "prefixmesh_registry_lookup_seconds",
    "Registry lookups at routing time, by backend and outcome",
    _FAST_BUCKETS,
    ("backend", "outcome"),
)
DECISION_SECONDS = HistogramSpec(
    "prefixmesh_routing_decision_seconds",
    "Time of one routing decision (registry lookup included)",
    _FAST_BUCKETS,
)
HOLDS = CounterSpec("prefixmesh_routing_holds", "Decisions that told the replica to hold")
FALLBACKS = CounterSpec(
    "prefixmesh_routing_fallbacks",
    "Decisions made without the registry's answer or the policy, by reason",
    ("reason",),
)
REPLICA_LOAD = GaugeSpec(
    "prefixmesh_replica_load",
    "Each replica's load as the router weighed it at its latest decision: its ledger (Serve's "
    "callbacks, or the replicas' progress on the direct path); on the direct path with Redis "
    "an estimate, the latest report plus the requests routed since that no report lists yet, "
    "counted queued finished or not (reports lag a second or more)",
    ("replica", "field"),
)
ONGOING = GaugeSpec(
    "prefixmesh_router_ongoing_requests",
    "Requests this router counts as sent and not done (its ledger, at its latest decision): "
    "not yet seen finish (Serve's callbacks, or the replicas' progress on the direct path); "
    "on the direct path with Redis, not yet listed by a replica's report",
)
REGISTRY_DEGRADED = GaugeSpec(
    "prefixmesh_registry_degraded",
    "1 on the reason the router's latest registry health check (its /health and Serve's "
    "periodic check) found the configured registry degraded: unreachable, timeout, auth "
    "(password missing or refused), tls, fingerprint (another cluster's registry), error; "
    "0 on the others; all 0: healthy (routing then uses the registry)",
    ("reason",),
)
ROUTER_METRICS = (
    DECISIONS,
    MATCHED_BLOCKS,
    LOOKUP_SECONDS,
    DECISION_SECONDS,
    HOLDS,
    FALLBACKS,
    REPLICA_LOAD,
    ONGOING,
    REGISTRY_DEGRADED,
)


class RouterMetrics:
    """What the request router decided and what it saw."""

    def __init__(self, cluster: MetricSink | None = None) -> None:
        """``cluster``: where the cluster's view gets the values (default: Ray's agent inside a
        Serve replica, nowhere elsewhere)."""
        local = PrometheusSink()
        self._local = local
        self.registry = local.registry
        sink = Tee(local, cluster if cluster is not None else serve_replica_sink())
        self.decisions = DECISIONS.build(sink)
        self.matched_blocks = MATCHED_BLOCKS.build(sink)
        self.lookup_seconds = LOOKUP_SECONDS.build(sink)
        self.decision_seconds = DECISION_SECONDS.build(sink)
        self.holds = HOLDS.build(sink)
        self.fallbacks = FALLBACKS.build(sink)
        for reason in FALLBACK_REASONS:  # a zero series says "none", absence says nothing
            self.fallbacks.labels(reason=reason)
        self.replica_load = REPLICA_LOAD.build(sink)
        self.ongoing = ONGOING.build(sink)
        self.registry_degraded = REGISTRY_DEGRADED.build(sink)
        self._degraded_children = {
            reason: self.registry_degraded.labels(reason=reason) for reason in DEGRADED_REASONS
        }
        self.registry_checked("")  # healthy until a check says otherwise
        self._load_children: dict[str, tuple[GaugeInstrument, GaugeInstrument, GaugeInstrument]]
        self._load_children = {}

    def render(self) -> str:
        """This router's own Prometheus exposition."""
        return self._local.render()

    def decided(
        self, policy: str, reason: str, matched_blocks: int, tier: str, hold: bool, seconds: float
    ) -> None:
        self.decisions.labels(policy=policy, reason=reason).inc()
        self.matched_blocks.labels(tier=tier).observe(matched_blocks)
        self.decision_seconds.observe(seconds)
        if hold:
            self.holds.inc()

    def looked_up(self, backend: str, outcome: str, seconds: float) -> None:
        self.lookup_seconds.labels(backend=backend, outcome=outcome).observe(seconds)

    def fell_back(self, reason: str) -> None:
        self.fallbacks.labels(reason=reason).inc()

    def registry_checked(self, reason: str) -> None:
        """The latest registry health check's reason (``""``: healthy)."""
        for name, child in self._degraded_children.items():
            child.set(1 if name == reason else 0)

    def saw_load(self, replica: str, queued: int, running: int, pending_tokens: int) -> None:
        children = self._load_children.get(replica)
        if children is None:  # label lookups cost a lock and a dict: once per replica
            q, r, p = (self.replica_load.labels(replica=replica, field=f) for f in LOAD_FIELDS)
            children = self._load_children[replica] = (q, r, p)
        children[0].set(queued)
        children[1].set(running)
        children[2].set(pending_tokens)

    def forget_replica(self, replica: str) -> None:
        """A replica that left stops being reported (its last load would linger forever) in
        this router's own text; Ray's agent keeps its last value (it cannot drop a series)."""
        if self._load_children.pop(replica, None) is None:
            return
        for field in LOAD_FIELDS:
            with contextlib.suppress(KeyError):  # another thread removed it first
                self.replica_load.remove(replica, field)
