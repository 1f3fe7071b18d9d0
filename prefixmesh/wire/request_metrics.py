"""Prometheus metrics of the server that answers requests (the proxy path's ingress, the direct
path's replica): statuses, time to first token, tokens, holds, retries. Each object has its own
registry, so two servers in one process never collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

if TYPE_CHECKING:
    from prefixmesh.wire.generation import Generation

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
_HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class RequestMetrics:
    """What the server that answers requests saw: statuses, TTFT, tokens, holds, retries."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixmesh_requests", "Requests answered", ["status"], registry=r)
        self.ttft = Histogram(
            "prefixmesh_ttft_seconds",
            "Time to first token, from when the request entered the cluster",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("prefixmesh_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "prefixmesh_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            registry=r,
        )
        self.completion_tokens = Counter(
            "prefixmesh_completion_tokens", "Generated tokens", registry=r
        )
        self.hold_seconds = Histogram(
            "prefixmesh_hold_seconds",
            "Time a request waited in a delay-hit hold on its replica",
            buckets=_HOLD_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "prefixmesh_request_retries",
            "Requests sent again to another replica after theirs failed, by phase and error",
            ["phase", "error"],
            registry=r,
        )
        self.stream_errors = Counter(
            "prefixmesh_stream_errors",
            "Streams ended with an error event after their first token",
            registry=r,
        )

    def error(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def retried(self, phase: str, error: str) -> None:
        self.retries.labels(phase=phase, error=error).inc()

    def first_token(self, generation: Generation) -> None:
        if generation.first_token_s is not None:
            self.ttft.observe(generation.first_token_s)
        self.prompt_tokens.inc(generation.usage.prompt_tokens)
        self.cached_tokens.inc(generation.usage.cached_tokens)
        request = generation.request
        if generation.held_s > 0 or (request is not None and request.hold is not None):
            self.hold_seconds.observe(generation.held_s)

    def finished(self, generation: Generation) -> None:
        self.requests.labels(status="200").inc()
        self.completion_tokens.inc(generation.usage.completion_tokens)

    def render(self, *others: CollectorRegistry) -> str:
        """This registry and ``others`` (a router's, in its process) in one exposition."""
        return b"".join(generate_latest(r) for r in (self.registry, *others)).decode()
