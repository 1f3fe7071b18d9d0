"""OpenTelemetry tracing, set up once per process from the ``telemetry`` config section.

Every process that handles requests (the ingress with its request router, each replica) calls
``setup`` at start. ``tracing=none`` leaves the API's no-op tracer in place and callers skip
their span code behind ``enabled()``, so tracing off costs a module-global read per seam.

The provider is this module's own, not the global one: ``setup`` stays idempotent and
testable (``reset``), and nothing else in these processes is instrumented. The trace context
crosses processes as a W3C carrier dict (``inject`` / ``extract``): inside the request object on
the proxy path, in the router's ticket (trusted headers) on the direct path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from prefixmesh.config import TelemetryConfig

logger = logging.getLogger(__name__)
TRACER_NAME = "prefixmesh"
_PROPAGATOR = TraceContextTextMapPropagator()
_NOOP_TRACER: trace.Tracer = trace.NoOpTracer()


@dataclass(frozen=True, slots=True)
class _Setup:
    config: TelemetryConfig
    role: str
    provider: Any
    """The SDK ``TracerProvider`` (typed loosely: the SDK is imported only when tracing)."""
    tracer: trace.Tracer
    memory: Any = None
    """The ``InMemorySpanExporter`` of ``tracing=memory``."""


_lock = threading.Lock()
_setup: _Setup | None = None
_enabled = False


def setup(config: TelemetryConfig, role: str) -> None:
    """Install the tracer of ``config`` in this process; later calls keep the first setup
    (the ingress and its request router share a process and both call this)."""
    global _setup, _enabled
    with _lock:
        if _setup is not None:
            if _setup.config != config:
                logger.warning(
                    "tracing is already set up (%s, role %s); ignoring another config",
                    _setup.config.tracing,
                    _setup.role,
                )
            return
        if config.tracing == "none":
            _setup = _Setup(config, role, None, _NOOP_TRACER)
            return
        _setup = _build(config, role)
        _enabled = True


def _build(config: TelemetryConfig, role: str) -> _Setup:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {"service.name": config.service_name, "prefixmesh.role": role, "process.pid": os.getpid()}
    )
    # ParentBased: a client's sampled traceparent is followed, and every hop of one request
    # agrees with the ingress's decision.
    sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
    provider = TracerProvider(sampler=sampler, resource=resource)
    memory = None
    if config.tracing == "otlp":
        # Imported only here: the exporter pulls in requests and protobuf.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint))
        )
    else:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    return _Setup(config, role, provider, provider.get_tracer(TRACER_NAME), memory)


def enabled() -> bool:
    """True when spans are recorded and exported: callers skip all span work otherwise."""
    return _enabled


def tracer() -> trace.Tracer:
    """This process's tracer (the API's no-op tracer before ``setup`` or with ``none``)."""
    return _setup.tracer if _setup is not None else _NOOP_TRACER


def inject(span: trace.Span) -> dict[str, str]:
    """The W3C carrier (``traceparent``, maybe ``tracestate``) that makes ``span`` the parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The context of a carrier (an HTTP header mapping, or a request's ``trace_context``);
    None when there is none, so the span becomes a root."""
    if not carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def span_context(carrier: Mapping[str, str] | None) -> trace.SpanContext | None:
    """The span a carrier names, or None when it names none (absent or malformed)."""
    context = extract(carrier)
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def finished_spans(clear: bool = False) -> list[dict[str, Any]]:
    """Spans finished in this process, as plain dicts (``tracing=memory`` only, else [])."""
    memory = _setup.memory if _setup is not None else None
    if memory is None:
        return []
    spans = [_as_dict(span) for span in memory.get_finished_spans()]
    if clear:
        memory.clear()
    return spans


def _as_dict(span: Any) -> dict[str, Any]:
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp} for e in span.events],
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
        "role": span.resource.attributes.get("prefixmesh.role"),
    }


def force_flush(timeout_ms: int = 5_000) -> bool:
    """Export what the batch processor still holds (tests; a process about to exit)."""
    provider = _setup.provider if _setup is not None else None
    return True if provider is None else bool(provider.force_flush(timeout_ms))


def reset() -> None:
    """Shut the provider down and forget the setup (tests set up several configs)."""
    global _setup, _enabled
    with _lock:
        if _setup is not None and _setup.provider is not None:
            _setup.provider.shutdown()
        _setup = None
        _enabled = False
