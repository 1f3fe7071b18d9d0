"""The spans of one request where it is routed. On the proxy path, in the ingress process:
``prefixmesh.request`` (arrival to the last byte) and, under it, one ``prefixmesh.route`` per
routing decision. On the direct path, in the router process: ``prefixmesh.router.request``
(HAProxy's ``/internal/route`` call: parse, tokenize, hash, decide) and the ``prefixmesh.route``
under it.

The trace context rides in ``GenerateRequest.trace_context``: the ingress (or the router) puts
its request span's there; each routing decision's context (``RouteTrace.carrier``) goes in its
ticket and on the replica's copy of the request (the replica's spans become the decision's
children), with the request span's under ``ORIGIN``, so that a decision made again for the
same request (Serve re-routes when a replica refuses it) is a sibling of the first, not its
child. On the direct path the decision's context reaches the replica in the ticket's headers
(``wire/route_ticket.py``).

HAProxy sends the router only the client's body and a few named headers, not ``traceparent``;
one of them is Serve's session header, whose name ``local_ray.haproxy_environment`` sets to
``traceparent``, so the router's span continues the client's trace. Where HAProxy was set up
without it, the replica sees both traces and continues the client's, linking the router's
decision (``replica/serving/spans.py``). With tracing off the factories return shared objects that
do nothing and nothing else runs (no attribute dicts are built).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from prefixmesh import tracing
from prefixmesh.cache_registry.types import PrefixHit
from prefixmesh.router.policy.base import RouteDecision
from prefixmesh.wire import GenerateRequest

ORIGIN = "prefixmesh-origin"
"""Key in ``trace_context`` holding the ingress request span's ``traceparent``."""
_TRACEPARENT = "traceparent"

# ---- the ingress's request span ------------------------------------------------------------


class NoRequestTrace:
    """Tracing off: every call is a no-op and ``carrier`` is None."""

    __slots__ = ()
    carrier: dict[str, str] | None = None

    def retried(self, phase: str, exc: BaseException) -> None:
        pass

    def answered(self, generation: Any, retries: int) -> None:
        pass

    def end(self, generation: Any = None, error: BaseException | None = None) -> None:
        pass


NO_REQUEST_TRACE = NoRequestTrace()


class RequestTrace(NoRequestTrace):
    __slots__ = ("_ended", "_span", "carrier")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._ended = False
        self.carrier = tracing.inject(span)
        """For ``GenerateRequest.trace_context`` (every attempt starts from it)."""

    def retried(self, phase: str, exc: BaseException) -> None:
        self._span.add_event("retry", {"phase": phase, "error": type(exc).__name__})

    def answered(self, generation: Any, retries: int) -> None:
        """The first token is in (``generation``: ``api.generation.Generation``)."""
        if not self._span.is_recording():
            return
        ticket = generation.ticket
        self._span.set_attributes(
            {
                "prefixmesh.retries": retries,
                "prefixmesh.replica": generation.replica_id,
                "prefixmesh.matched_blocks": ticket.matched_blocks if ticket else 0,
                "prefixmesh.routed_by": ticket.reason if ticket else "",
                "prefixmesh.cached_tokens": generation.usage.cached_tokens,
                "prefixmesh.hold_s": generation.held_s,
                "prefixmesh.ttft_s": generation.first_token_s or 0.0,
            }
        )

    def end(self, generation: Any = None, error: BaseException | None = None) -> None:
        """The response is complete (or failed with ``error``); idempotent."""
        if self._ended:
            return
        self._ended = True
        if generation is not None and self._span.is_recording():
            self._span.set_attribute(
                "prefixmesh.completion_tokens", generation.usage.completion_tokens
            )
        if error is not None:
            status = getattr(error, "status", None)
            if status is not None:
                self._span.set_attribute("http.response.status_code", int(status))
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self._span.end()


def request_trace(
    headers: Mapping[str, str], request_id: str, prompt_tokens: int, stream: bool, start_ns: int
) -> NoRequestTrace:
    """The request span, from ``start_ns`` (arrival, wall clock), continuing a client's
    ``traceparent`` header if it sent one."""
    if not tracing.enabled():
        return NO_REQUEST_TRACE
    span = tracing.tracer().start_span(
        "prefixmesh.request",
        context=tracing.extract(headers),
        kind=SpanKind.SERVER,
        start_time=start_ns,
    )
    if span.is_recording():
        span.set_attributes(
            {
                "prefixmesh.request_id": request_id,
                "prefixmesh.prompt_tokens": prompt_tokens,
                "prefixmesh.stream": stream,
            }
        )
    return RequestTrace(span)


# ---- the direct path's routing call --------------------------------------------------------


class NoRouterTrace:
    """Tracing off: every call is a no-op and ``carrier`` is None."""

    __slots__ = ()
    carrier: dict[str, str] | None = None

    def fell_back(self, reason: str, exc: BaseException | None = None) -> None:
        pass

    def chose(self, replica: str, request: GenerateRequest | None) -> None:
        pass

    def end(self) -> None:
        pass


NO_ROUTER_TRACE = NoRouterTrace()


class RouterTrace(NoRouterTrace):
    __slots__ = ("_fallback", "_span", "_truncated", "carrier")

    def __init__(self, span: Span, truncated: bool) -> None:
        self._span = span
        self._truncated = truncated
        self._fallback: str | None = None
        self.carrier = tracing.inject(span)
        """For ``GenerateRequest.trace_context``: the decision's span becomes its child."""

    def fell_back(self, reason: str, exc: BaseException | None = None) -> None:
        """The decision failed (``timeout``, ``error``): a load-balanced pick follows."""
        self._fallback = reason
        if exc is not None and not isinstance(exc, TimeoutError):
            self._span.record_exception(exc)

    def chose(self, replica: str, request: GenerateRequest | None) -> None:
        """The answer names ``replica``; ``request`` is None for a pick without a decision."""
        if not self._span.is_recording():
            return
        attributes: dict[str, Any] = {"prefixmesh.replica": replica}
        if request is not None:
            attributes["prefixmesh.request_id"] = request.request_id
            attributes["prefixmesh.prompt_tokens"] = len(request.prompt_token_ids)
        else:  # the replica answers an invalid body's OpenAI error itself
            attributes["prefixmesh.fallback_reason"] = self._fallback or (
                "body_truncated" if self._truncated else "invalid_body"
            )
        self._span.set_attributes(attributes)

    def end(self) -> None:
        self._span.end()


def router_trace(headers: Mapping[str, str], start_ns: int, truncated: bool) -> NoRouterTrace:
    """The span of one ``/internal/route`` call from ``start_ns`` (arrival, wall clock),
    continuing the client's ``traceparent`` when HAProxy forwarded it (module docstring);
    ``truncated``: HAProxy sent only the head of the body."""
    if not tracing.enabled():
        return NO_ROUTER_TRACE
    span = tracing.tracer().start_span(
        "prefixmesh.router.request",
        context=tracing.extract(headers),
        kind=SpanKind.SERVER,
        start_time=start_ns,
    )
    if truncated and span.is_recording():
        span.set_attribute("prefixmesh.body_truncated", True)
    return RouterTrace(span, truncated)


# ---- the routing decision's span -----------------------------------------------------------


class NoRouteTrace:
    """Tracing off: ``decided`` does nothing and ``carrier`` is None."""

    __slots__ = ()
    carrier: dict[str, str] | None = None

    def decided(self, policy: str, decision: RouteDecision, matched_blocks: int) -> None:
        pass


NO_ROUTE_TRACE = NoRouteTrace()


class RouteTrace(NoRouteTrace):
    __slots__ = ("_span", "carrier")

    def __init__(self, span: Span) -> None:
        self._span = span
        self.carrier: dict[str, str] | None = None
        """The decision's context for the replica, once the span ended without an error."""

    def decided(self, policy: str, decision: RouteDecision, matched_blocks: int) -> None:
        """Record the decision (``matched_blocks``: what the chosen replica holds)."""
        if not self._span.is_recording():
            return
        attributes: dict[str, Any] = {
            "prefixmesh.policy": policy,
            "prefixmesh.reason": decision.reason,
            "prefixmesh.replica": decision.chosen,
            "prefixmesh.matched_blocks": matched_blocks,
            "prefixmesh.hold": decision.hold is not None,
        }
        if decision.hold is not None:
            attributes["prefixmesh.hold_blocks"] = decision.hold.num_blocks
            attributes["prefixmesh.hold_max_wait_s"] = decision.hold.max_wait_s
        self._span.set_attributes(attributes)


def route_span(request: GenerateRequest | None) -> AbstractContextManager[NoRouteTrace]:
    """Around one routing decision for ``request``: the ``prefixmesh.route`` span, current
    while it runs (``note_lookup`` and ``note_hit`` find it), its context for the replica in
    the trace's ``carrier`` on success. An exception is recorded with
    ``prefixmesh.fallback_reason=error``."""
    if request is None or request.trace_context is None or not tracing.enabled():
        return nullcontext(NO_ROUTE_TRACE)
    return _route_span(request, request.trace_context)


@contextmanager
def _route_span(request: GenerateRequest, carrier: Mapping[str, str]) -> Iterator[NoRouteTrace]:
    origin = carrier.get(ORIGIN) or carrier.get(_TRACEPARENT, "")
    span = tracing.tracer().start_span(
        "prefixmesh.route", context=tracing.extract({_TRACEPARENT: origin})
    )
    if span.is_recording():
        span.set_attribute("prefixmesh.request_id", request.request_id)
        if ORIGIN in carrier:  # this request was routed before: Serve is routing it again
            span.set_attribute("prefixmesh.rerouted", True)
        if request.avoid_replicas:  # an ingress retry
            span.set_attribute("prefixmesh.avoid_replicas", list(request.avoid_replicas))
    started = time.perf_counter()
    route = RouteTrace(span)
    with trace.use_span(span, end_on_exit=True):
        try:
            yield route
        except Exception:  # the router falls back to power of two (not on a cancellation)
            span.set_attribute("prefixmesh.fallback_reason", "error")
            raise
        finally:
            span.set_attribute("prefixmesh.decision_ms", (time.perf_counter() - started) * 1e3)
        route.carrier = {**tracing.inject(span), ORIGIN: origin}


def note_lookup(backend: str, outcome: str, elapsed_s: float) -> None:
    """The registry lookup of the decision in progress (``ok``, ``empty``, ``timeout``,
    ``unavailable``); a timeout or an unavailable registry is the decision's fallback reason."""
    if not tracing.enabled():
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, Any] = {
        "prefixmesh.registry_backend": backend,
        "prefixmesh.registry_outcome": outcome,
        "prefixmesh.registry_lookup_ms": elapsed_s * 1e3,
    }
    if outcome in ("timeout", "unavailable"):
        attributes["prefixmesh.fallback_reason"] = f"registry_{outcome}"
    span.set_attributes(attributes)


def note_hit(hit: PrefixHit | None) -> None:
    """The chosen replica's registry hit: its blocks and the deepest tier they need."""
    if not tracing.enabled():
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    tier = hit.deepest_tier.name if hit is not None and hit.num_blocks else "NONE"
    span.set_attributes(
        {
            "prefixmesh.tier": tier,
            "prefixmesh.speculative_blocks": hit.num_speculative if hit is not None else 0,
        }
    )
