"""Prometheus metrics of the ingress (its own registry, so two ingresses in one process never
collide) plus the request router's counters, rendered at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

if TYPE_CHECKING:
    from prefixmesh.router.generation import Generation

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixmesh_requests", "Requests answered", ["status"], registry=r)
        self.ttft = Histogram(
            "prefixmesh_ttft_seconds",
            "Time to first token seen by the ingress",
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

    def error(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def first_token(self, generation: Generation) -> None:
        if generation.first_token_s is not None:
            self.ttft.observe(generation.first_token_s)
        self.prompt_tokens.inc(generation.usage.prompt_tokens)
        self.cached_tokens.inc(generation.usage.cached_tokens)

    def finished(self, generation: Generation) -> None:
        self.requests.labels(status="200").inc()
        self.completion_tokens.inc(generation.usage.completion_tokens)

    def render(
        self, decisions: int, fallbacks: int, holds: int, reasons: dict[str, int], ongoing: int
    ) -> str:
        lines = [
            "# TYPE prefixmesh_routing_decisions_total counter",
            *(
                f'prefixmesh_routing_decisions_total{{reason="{k}"}} {v}'
                for k, v in sorted(reasons.items())
            ),
            "# TYPE prefixmesh_routing_fallbacks_total counter",
            f"prefixmesh_routing_fallbacks_total {fallbacks}",
            "# TYPE prefixmesh_routing_holds_total counter",
            f"prefixmesh_routing_holds_total {holds}",
            "# TYPE prefixmesh_router_ongoing_requests gauge",
            f"prefixmesh_router_ongoing_requests {ongoing}",
        ]
        del decisions  # the per-reason counts add up to it
        return generate_latest(self.registry).decode() + "\n".join(lines) + "\n"
