"""The spans of one request inside a replica, children of the routing decision's span.

``prefixmesh.replica.generate`` covers the request's whole stay; under it ``...queue`` runs from
arrival to the engine submit (a delay-hit hold included), ``...prefill`` from the submit to the
first token (its end is the first-token time; it also carries a ``first_token`` event) and
``...decode`` from the first token to the end. With tracing off ``replica_trace`` returns a
shared object whose methods do nothing.

On the direct path the parent comes from two places (``trace_parent``): the router's ticket
(its decision's span) and the client's own ``traceparent``, which HAProxy forwards here. They
are one trace when HAProxy handed the router the client's header too (``router/core/spans.py``);
when they are not, the client's trace is the one its owner looks up, so the replica's spans
continue it and link the router's decision.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, set_span_in_context

from prefixmesh import tracing
from prefixmesh.wire import GenerateRequest, Hold

LINKED = "prefixmesh-linked"
"""Key in ``trace_context`` holding the ``traceparent`` of a routing decision made in another
trace than the client's: the replica's span links it."""
_TRACE_FIELDS = ("traceparent", "tracestate")


class NoTrace:
    """Tracing off (or this trace not sampled): every call is a no-op."""

    __slots__ = ()

    def queued(self, hold: Hold | None, held_s: float) -> None:
        pass

    def first_token(self, cached_tokens: int) -> None:
        pass

    def failed(self, exc: BaseException) -> None:
        pass

    def end(self, output_tokens: int, finish_reason: str | None) -> None:
        pass


NO_TRACE = NoTrace()


class ReplicaTrace(NoTrace):
    __slots__ = ("_closed", "_phase", "_root")

    def __init__(self, root: Span) -> None:
        self._root = root
        self._closed = False
        self._phase = self._child("prefixmesh.replica.queue")

    def _child(self, name: str) -> Span:
        return tracing.tracer().start_span(name, context=set_span_in_context(self._root))

    def queued(self, hold: Hold | None, held_s: float) -> None:
        """The request leaves the queue for the engine, after waiting ``held_s`` in ``hold``."""
        if hold is not None:
            attributes = {
                "prefixmesh.hold": True,
                "prefixmesh.hold_s": held_s,
                "prefixmesh.hold_blocks": hold.num_blocks,
                "prefixmesh.hold_max_wait_s": hold.max_wait_s,
            }
            self._phase.set_attributes(attributes)
            self._root.set_attributes(attributes)
        self._phase.end()
        self._phase = self._child("prefixmesh.replica.prefill")

    def first_token(self, cached_tokens: int) -> None:
        self._phase.add_event("first_token")
        self._phase.set_attribute("prefixmesh.cached_tokens", cached_tokens)
        self._root.set_attribute("prefixmesh.cached_tokens", cached_tokens)
        self._phase.end()
        self._phase = self._child("prefixmesh.replica.decode")

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, Exception):
            self._root.record_exception(exc)
            self._root.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        else:  # GeneratorExit or CancelledError: the caller closed the stream
            self._closed = True

    def end(self, output_tokens: int, finish_reason: str | None) -> None:
        self._phase.end()
        self._root.set_attribute("prefixmesh.output_tokens", output_tokens)
        if finish_reason is not None:
            self._root.set_attribute("prefixmesh.finish_reason", finish_reason)
        elif self._closed:  # closed before its end (a stop string, a client gone); the ingress
            # also closes finished streams, which is no cancellation
            self._root.set_attribute("prefixmesh.cancelled", True)
        self._root.end()


def trace_parent(
    ticket_context: Mapping[str, str] | None, headers: Mapping[str, str]
) -> dict[str, str] | None:
    """The direct path's ``trace_context`` from the router's ticket and the client's headers:
    the decision's when both are one trace or the client sent none, else the client's with
    the decision under ``LINKED``; None when tracing is off or neither names a span."""
    if not tracing.enabled():
        return None
    client = {field: headers[field] for field in _TRACE_FIELDS if headers.get(field)}
    client_span = tracing.span_context(client)
    router_span = tracing.span_context(ticket_context)
    if ticket_context is None or router_span is None:
        return client if client_span is not None else None
    if client_span is None or client_span.trace_id == router_span.trace_id:
        return dict(ticket_context)
    return {**client, LINKED: ticket_context["traceparent"]}


def replica_trace(request: GenerateRequest, replica_id: str) -> NoTrace:
    """The trace of ``request`` on this replica, continuing its ``trace_context``."""
    if not tracing.enabled():
        return NO_TRACE
    carrier = request.trace_context
    decision = carrier.get(LINKED) if carrier else None
    linked = tracing.span_context({"traceparent": decision}) if decision else None
    root = tracing.tracer().start_span(
        "prefixmesh.replica.generate",
        context=tracing.extract(carrier),
        kind=SpanKind.SERVER,
        links=[Link(linked, {"prefixmesh.link": "route"})] if linked is not None else None,
    )
    if not root.is_recording():  # not sampled: skip the children and attributes too
        return NO_TRACE
    root.set_attributes(
        {
            "prefixmesh.request_id": request.request_id,
            "prefixmesh.replica": replica_id,
            "prefixmesh.prompt_tokens": len(request.prompt_token_ids),
            "prefixmesh.tenant": request.tenant,
            "prefixmesh.priority": request.priority,
        }
    )
    routed_to = request.ticket.replica_id if request.ticket is not None else ""
    if routed_to and routed_to != replica_id:
        # The decision chose another replica (HAProxy redispatched it, or Serve took a lower
        # rank of the decision's).
        root.set_attribute("prefixmesh.routed_to", routed_to)
    return ReplicaTrace(root)
