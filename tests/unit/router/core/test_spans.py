"""Spans at the ingress and routing seams, with fake replicas, the in-process registry and the
SDK's in-memory exporter: no Ray cluster."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from prefixmesh import tracing
from prefixmesh.api.errors import APIError
from prefixmesh.config import TelemetryConfig
from prefixmesh.router.core.spans import (
    NO_REQUEST_TRACE,
    NO_ROUTER_TRACE,
    ORIGIN,
    note_lookup,
    request_trace,
    route_span,
    router_trace,
)
from prefixmesh.wire import GenerateRequest, RouteTicket
from tests.unit.router.core.test_serve_router import (
    BLOCKS,
    fake_replica,
    hold_prefix,
    make_router,
    pending,
    request_for,
    sent,
    taken,
)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def memory() -> Iterator[None]:
    tracing.reset()
    tracing.setup(TelemetryConfig(tracing="memory"), "ingress")
    yield
    tracing.reset()


def spans_named(name: str) -> list[dict[str, Any]]:
    return [s for s in tracing.finished_spans() if s["name"] == name]


def traced_request(blocks: Any = BLOCKS) -> tuple[GenerateRequest, Any]:
    """A request as the ingress sends it: its trace context is the request span's."""
    trace = request_trace({}, "cmpl-1", len(blocks) * 128 + 5, False, 0)
    request = dataclasses.replace(request_for(blocks), trace_context=trace.carrier)
    return request, trace


# ---- ingress -------------------------------------------------------------------------------


def _generation(ticket: RouteTicket) -> Any:
    return SimpleNamespace(
        ticket=ticket,
        replica_id="r2",
        usage=SimpleNamespace(cached_tokens=256, completion_tokens=7),
        held_s=0.25,
        first_token_s=0.5,
    )


def test_the_request_span_continues_a_client_traceparent(memory: None) -> None:
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "host": "x"}
    trace = request_trace(headers, "cmpl-1", 300, True, 1_000)
    assert trace.carrier is not None and CLIENT_TRACE in trace.carrier["traceparent"]
    ticket = RouteTicket("cmpl-1", "r1", "affinity", 4)
    trace.retried("before_first_token", ConnectionError())
    trace.answered(_generation(ticket), retries=1)
    trace.end(_generation(ticket))
    trace.end()  # idempotent: a stream's finally ends it again

    (span,) = spans_named("prefixmesh.request")
    assert (span["trace_id"], span["parent_span_id"]) == (CLIENT_TRACE, CLIENT_SPAN)
    assert span["kind"] == "SERVER" and span["start_ns"] == 1_000
    assert span["attributes"] == {
        "prefixmesh.request_id": "cmpl-1",
        "prefixmesh.prompt_tokens": 300,
        "prefixmesh.stream": True,
        "prefixmesh.retries": 1,
        "prefixmesh.replica": "r2",
        "prefixmesh.matched_blocks": 4,
        "prefixmesh.routed_by": "affinity",
        "prefixmesh.cached_tokens": 256,
        "prefixmesh.hold_s": 0.25,
        "prefixmesh.ttft_s": 0.5,
        "prefixmesh.completion_tokens": 7,
    }
    assert [e["name"] for e in span["events"]] == ["retry"]


def test_a_failed_request_span_carries_the_error_and_status(memory: None) -> None:
    trace = request_trace({}, "cmpl-1", 10, False, 0)
    trace.end(error=APIError(503, "no replica", error_type="server_error"))
    (span,) = spans_named("prefixmesh.request")
    assert span["status"] == "ERROR" and span["parent_span_id"] is None
    assert span["attributes"]["http.response.status_code"] == 503


def test_tracing_off_is_the_shared_no_op() -> None:
    tracing.reset()
    assert request_trace({}, "cmpl-1", 10, False, 0) is NO_REQUEST_TRACE
    assert NO_REQUEST_TRACE.carrier is None


# ---- routing decision ----------------------------------------------------------------------


async def test_route_span_attributes(memory: None) -> None:
    router = make_router()
    hold_prefix(router, "r2")
    request, trace = traced_request()
    ingress_context = dict(request.trace_context or {})
    call = pending(request)
    await router.choose_replicas([fake_replica("r1"), fake_replica("r2")], call)
    trace.end()

    (route,) = spans_named("prefixmesh.route")
    (parent,) = spans_named("prefixmesh.request")
    assert route["parent_span_id"] == parent["span_id"]
    assert route["trace_id"] == parent["trace_id"]
    attributes = route["attributes"]
    assert attributes["prefixmesh.policy"] == "prefixmesh"
    assert attributes["prefixmesh.replica"] == "r2"
    assert attributes["prefixmesh.matched_blocks"] == len(BLOCKS)
    assert attributes["prefixmesh.tier"] == "GPU"
    ticket = sent(call).ticket
    assert ticket is not None
    assert attributes["prefixmesh.reason"] == ticket.reason != ""
    assert attributes["prefixmesh.registry_outcome"] == "ok"
    assert attributes["prefixmesh.registry_lookup_ms"] >= 0
    assert "prefixmesh.fallback_reason" not in attributes
    assert attributes["prefixmesh.hold"] is False
    # The replica's spans become the decision's children; the ingress's is kept for re-routing.
    context = sent(call).trace_context
    assert context is not None and context == ticket.trace_context
    assert route["span_id"] in context["traceparent"]
    assert context[ORIGIN] == ingress_context["traceparent"]
    assert request.trace_context == ingress_context  # the caller's request is unchanged


async def test_a_cold_prefix_has_no_tier(memory: None) -> None:
    router = make_router()
    request, _ = traced_request()
    await router.choose_replicas([fake_replica("r1")], pending(request))
    (route,) = spans_named("prefixmesh.route")
    assert route["attributes"]["prefixmesh.tier"] == "NONE"
    assert route["attributes"]["prefixmesh.matched_blocks"] == 0
    assert route["attributes"]["prefixmesh.registry_outcome"] == "empty"


async def test_a_second_decision_for_a_request_is_a_sibling_of_the_first(memory: None) -> None:
    router = make_router()
    request, _ = traced_request()
    replicas = [fake_replica("r1"), fake_replica("r2")]
    call = pending(request)
    await router.choose_replicas(replicas, call)
    await router.choose_replicas(replicas, call)  # Serve routes the same pending call again
    first, second = spans_named("prefixmesh.route")
    assert first["parent_span_id"] == second["parent_span_id"]
    assert second["attributes"]["prefixmesh.rerouted"] is True
    assert "prefixmesh.rerouted" not in first["attributes"]


async def test_a_routing_error_is_recorded_as_the_fallback(memory: None) -> None:
    router = make_router()

    async def broken(*_: Any) -> Any:
        raise RuntimeError("policy bug")

    router._core.decide = broken
    request, _ = traced_request()
    before = dict(request.trace_context or {})
    call = pending(request)
    ranked = await router.choose_replicas([fake_replica("r1")], call)
    assert ranked[0][0].replica_id.unique_id == "r1"  # power of two
    (route,) = spans_named("prefixmesh.route")
    assert route["status"] == "ERROR"
    assert route["attributes"]["prefixmesh.fallback_reason"] == "error"
    # The replica gets the request as it was: its spans hang off the request span.
    assert sent(call) is request and request.trace_context == before


async def test_a_retry_names_the_replicas_it_avoids(memory: None) -> None:
    router = make_router()
    request, _ = traced_request()
    request = dataclasses.replace(request, avoid_replicas=("r1",))
    await router.choose_replicas([fake_replica("r1"), fake_replica("r2")], pending(request))
    (route,) = spans_named("prefixmesh.route")
    assert route["attributes"]["prefixmesh.avoid_replicas"] == ("r1",)
    assert route["attributes"]["prefixmesh.replica"] == "r2"


def test_a_registry_timeout_is_the_decision_fallback_reason(memory: None) -> None:
    request, _ = traced_request()
    with route_span(request):
        note_lookup("redis", "timeout", 0.006)
    (route,) = spans_named("prefixmesh.route")
    assert route["attributes"]["prefixmesh.fallback_reason"] == "registry_timeout"
    assert route["attributes"]["prefixmesh.registry_lookup_ms"] == pytest.approx(6.0)


async def test_a_hung_registry_shows_as_a_registry_fallback(
    memory: None, silent_server: int
) -> None:
    router = make_router(
        "registry.backend=redis", f"registry.redis_url=redis://127.0.0.1:{silent_server}/0"
    )
    request, _ = traced_request()
    await router.choose_replicas([fake_replica("r1"), fake_replica("r2")], pending(request))
    (route,) = spans_named("prefixmesh.route")
    assert route["attributes"]["prefixmesh.fallback_reason"] in (
        "registry_timeout",
        "registry_unavailable",
    )
    assert route["attributes"]["prefixmesh.registry_backend"] == "redis"
    assert router._core.registry is not None
    await router._core.registry.close()


async def test_tracing_off_leaves_the_request_alone() -> None:
    tracing.reset()
    router = make_router()
    request = request_for(BLOCKS)
    call = pending(request)
    await router.choose_replicas([fake_replica("r1")], call)
    assert sent(call).trace_context is None and request.trace_context is None
    assert tracing.finished_spans() == []


# ---- the direct path's routing call --------------------------------------------------------


async def test_the_routing_call_continues_the_client_and_parents_the_decision(
    memory: None,
) -> None:
    # HAProxy forwards the client's traceparent under Serve's session header (local_ray).
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "x-request-id": "h1"}
    trace = router_trace(client, 1_000, truncated=False)
    request = dataclasses.replace(request_for(BLOCKS), trace_context=trace.carrier)
    router = make_router()
    await router.choose_replicas([fake_replica("r1")], pending(request))
    trace.chose("r1", request)
    trace.end()

    (call,) = spans_named("prefixmesh.router.request")
    (route,) = spans_named("prefixmesh.route")
    assert (call["trace_id"], call["parent_span_id"]) == (CLIENT_TRACE, CLIENT_SPAN)
    assert call["kind"] == "SERVER" and call["start_ns"] == 1_000
    assert (route["trace_id"], route["parent_span_id"]) == (CLIENT_TRACE, call["span_id"])
    assert call["attributes"] == {
        "prefixmesh.replica": "r1",
        "prefixmesh.request_id": request.request_id,
        "prefixmesh.prompt_tokens": len(request.prompt_token_ids),
    }
    # What the ticket hands the replica: the decision's context.
    ticket = taken(router, request)
    assert ticket is not None and ticket.trace_context is not None
    assert route["span_id"] in ticket.trace_context["traceparent"]


@pytest.mark.parametrize(
    ("truncated", "failure", "reason"),
    [
        (True, None, "body_truncated"),
        (False, None, "invalid_body"),
        (False, TimeoutError(), "timeout"),
        (False, RuntimeError("policy bug"), "error"),
    ],
)
def test_a_pick_without_a_decision_names_its_reason(
    memory: None, truncated: bool, failure: Exception | None, reason: str
) -> None:
    trace = router_trace({}, 0, truncated)
    if failure is not None:
        trace.fell_back("timeout" if isinstance(failure, TimeoutError) else "error", failure)
    trace.chose("r2", None)
    trace.end()
    (call,) = spans_named("prefixmesh.router.request")
    assert call["parent_span_id"] is None  # no client context: a root
    assert call["attributes"]["prefixmesh.replica"] == "r2"
    assert call["attributes"]["prefixmesh.fallback_reason"] == reason
    assert call["attributes"].get("prefixmesh.body_truncated", False) is truncated
    # A deadline is no error worth a stack; anything else is recorded.
    events = ["exception"] if isinstance(failure, RuntimeError) else []
    assert [e["name"] for e in call["events"]] == events


def test_tracing_off_the_routing_call_is_the_shared_no_op() -> None:
    tracing.reset()
    trace = router_trace({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, 0, False)
    assert trace is NO_ROUTER_TRACE and trace.carrier is None
    trace.chose("r1", None)
    trace.end()
    assert tracing.finished_spans() == []
