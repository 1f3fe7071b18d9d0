"""Prometheus metrics of the server that answers requests (the proxy path's ingress, the direct
path's replica): statuses, time to first token, tokens, holds, retries.

The specs (``REQUEST_METRICS``, and ``DIRECT_METRICS`` for the direct path's replica) say what
each metric is; the objects record into a prometheus_client registry of their own (two servers
in one process never collide; their ``/metrics``) and into the cluster's view (Ray's metrics
agent, labelled by Serve replica; nothing outside Serve).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixmesh.metrics.ray_sink import serve_replica_sink
from prefixmesh.metrics.sink import MetricSink, PrometheusSink, Tee
from prefixmesh.metrics.spec import CounterSpec, HistogramSpec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from prefixmesh.api.generation import Generation

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
_HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)

REQUESTS = CounterSpec("prefixmesh_requests", "Requests answered", ("status",))
TTFT = HistogramSpec(
    "prefixmesh_ttft_seconds",
    "Time to first token, from when the request entered the cluster",
    _TTFT_BUCKETS,
)
PROMPT_TOKENS = CounterSpec("prefixmesh_prompt_tokens", "Prompt tokens")
CACHED_TOKENS = CounterSpec(
    "prefixmesh_cached_prompt_tokens", "Prompt tokens served from a prefix cache"
)
COMPLETION_TOKENS = CounterSpec("prefixmesh_completion_tokens", "Generated tokens")
HOLD_SECONDS = HistogramSpec(
    "prefixmesh_hold_seconds",
    "Time a request waited in a delay-hit hold on its replica",
    _HOLD_BUCKETS,
)
RETRIES = CounterSpec(
    "prefixmesh_request_retries",
    "Requests sent again to another replica after theirs failed, by phase and error",
    ("phase", "error"),
)
STREAM_ERRORS = CounterSpec(
    "prefixmesh_stream_errors", "Streams ended with an error event after their first token"
)
TENANT_TOKENS = CounterSpec(
    "prefixmesh_tenant_tokens",
    "Tokens of admitted requests by tenant (the API key's; anonymous without keys) and kind "
    "(prompt, completion)",
    ("tenant", "kind"),
)
QUOTA_REFUSALS = CounterSpec(
    "prefixmesh_quota_refusals",
    "Requests refused with a 429 by tenant and the limit they hit (tokens, concurrency, too_large)",
    ("tenant", "limit"),
)
QUOTA_STORE_ERRORS = CounterSpec(
    "prefixmesh_quota_store_errors",
    "Quota checks and settlements the store failed or answered too late (the request was let "
    "in unless quotas.fail_closed)",
)
REQUEST_METRICS = (
    REQUESTS,
    TTFT,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    COMPLETION_TOKENS,
    HOLD_SECONDS,
    RETRIES,
    STREAM_ERRORS,
    TENANT_TOKENS,
    QUOTA_REFUSALS,
    QUOTA_STORE_ERRORS,
)

KEY_MISMATCHES = CounterSpec(
    "prefixmesh_route_key_mismatches",
    "Requests whose block-hash digest differed from the router's (tokenizer or hashing "
    "differ between them: routing is blind)",
)
REDISPATCHED = CounterSpec(
    "prefixmesh_redispatched_requests",
    "Requests served here that the router had sent to another replica (HAProxy retried them "
    "after that replica failed)",
)
UNROUTED = CounterSpec(
    "prefixmesh_unrouted_requests", "Requests that reached this replica without a routing decision"
)
DIRECT_METRICS = (KEY_MISMATCHES, REDISPATCHED, UNROUTED)


class RequestMetrics:
    """What the server that answers requests saw: statuses, TTFT, tokens, holds, retries."""

    def __init__(self, cluster: MetricSink | None = None) -> None:
        """``cluster``: where the cluster's view gets the values (default: Ray's agent inside a
        Serve replica, nowhere elsewhere)."""
        local = PrometheusSink()
        self.registry = local.registry
        self._sink = Tee(local, cluster if cluster is not None else serve_replica_sink())
        sink = self._sink
        self.requests = REQUESTS.build(sink)
        self.ttft = TTFT.build(sink)
        self.prompt_tokens = PROMPT_TOKENS.build(sink)
        self.cached_tokens = CACHED_TOKENS.build(sink)
        self.completion_tokens = COMPLETION_TOKENS.build(sink)
        self.hold_seconds = HOLD_SECONDS.build(sink)
        self.retries = RETRIES.build(sink)
        self.stream_errors = STREAM_ERRORS.build(sink)
        self.tenant_token_count = TENANT_TOKENS.build(sink)
        self.quota_refusals = QUOTA_REFUSALS.build(sink)
        self.quota_store_errors = QUOTA_STORE_ERRORS.build(sink)

    def error(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def retried(self, phase: str, error: str) -> None:
        self.retries.labels(phase=phase, error=error).inc()

    def first_token(self, generation: Generation) -> None:
        if generation.first_token_s is not None:
            self.ttft.observe(generation.first_token_s)
        self.prompt_tokens.inc(generation.usage.prompt_tokens)
        self.cached_tokens.inc(generation.usage.cached_tokens)
        ticket = generation.ticket
        if generation.held_s > 0 or (ticket is not None and ticket.hold is not None):
            self.hold_seconds.observe(generation.held_s)

    def finished(self, generation: Generation) -> None:
        self.requests.labels(status="200").inc()
        self.completion_tokens.inc(generation.usage.completion_tokens)

    # ---- QuotaMetrics (api/quota.py) ----------------------------------------------------------

    def quota_refused(self, tenant: str, limit: str) -> None:
        self.quota_refusals.labels(tenant=tenant, limit=limit).inc()

    def quota_store_failed(self) -> None:
        self.quota_store_errors.inc()

    def tenant_tokens(self, tenant: str, kind: str, tokens: int) -> None:
        self.tenant_token_count.labels(tenant=tenant, kind=kind).inc(tokens)

    def render(self, *others: CollectorRegistry) -> str:
        """This registry and ``others`` (a router's, in its process) in one exposition."""
        from prometheus_client import generate_latest

        return b"".join(generate_latest(r) for r in (self.registry, *others)).decode()


class DirectMetrics(RequestMetrics):
    """The direct path's replica: also what it found wrong with the router's decision."""

    def __init__(self, cluster: MetricSink | None = None) -> None:
        super().__init__(cluster)
        self.key_mismatches = KEY_MISMATCHES.build(self._sink)
        self.redispatched = REDISPATCHED.build(self._sink)
        self.unrouted = UNROUTED.build(self._sink)
