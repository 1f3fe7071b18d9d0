"""``telemetry``, ``metrics``: traces and Prometheus metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section


class TelemetryConfig(Section):
    """OpenTelemetry traces of each request: ingress -> routing decision -> replica."""

    tracing: Literal["none", "otlp", "memory"] = "none"
    """``none``: the API's no-op tracer (near zero cost); ``otlp``: export over OTLP/HTTP to
    ``otlp_endpoint`` in batches; ``memory``: keep every finished span in the process (tests and
    debugging: it grows without bound), read back through ``/admin/traces`` and the replicas'
    ``exported_spans``."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """OTLP/HTTP traces endpoint (a collector or Jaeger/Tempo) for ``tracing=otlp``."""
    service_name: str = Field(default="prefixmesh", min_length=1)
    """``service.name`` of every process's spans (each also carries ``prefixmesh.role``)."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """Fraction of new traces recorded; a request that arrives with a ``traceparent`` follows
    its caller's sampling decision instead."""


class MetricsConfig(Section):
    """Prometheus metrics: every serving process's, through Ray's metrics agent
    (docs/metrics.md)."""

    export_port: int = Field(default=0, ge=0, le=65535)
    """Port of Ray's metrics agent on a Ray that ``prefixmesh serve`` starts: one endpoint per
    node with the router's and replicas' metrics (``ray_prefixmesh_*``, labelled per Serve
    replica), vLLM's (``ray_vllm_*``) and Ray's own; 0: a free port. It listens on 127.0.0.1
    like the rest of a local start; a cluster joined with ``ray.address`` has its nodes'
    ``ray start --metrics-export-port``."""
