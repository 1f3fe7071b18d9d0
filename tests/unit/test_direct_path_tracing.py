"""One trace along the direct path without Ray: the client's traceparent as HAProxy hands it to
the router, the router's ``/internal/route`` call and decision, the ticket, and the replica's
spans from the ticket and the client's headers. Serve's replica handle is a fake whose request
router decides inside ``route_span`` as ours does."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from prefixmesh import tracing
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.config import TelemetryConfig
from prefixmesh.replica.serving.spans import replica_trace, trace_parent
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.router.core.spans import route_span
from prefixmesh.router.front.route_server import RouterServer
from prefixmesh.wire import GenerateRequest, SamplingSettings
from prefixmesh.wire.route_ticket import RouteTicket

KEY = BlockHasher(4, "m").hash_tokens(list(range(10)))
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
REPLICA_SPANS = ("generate", "queue", "prefill", "decode")


@pytest.fixture(autouse=True)
def memory() -> Iterator[None]:
    tracing.reset()
    tracing.setup(TelemetryConfig(tracing="memory"), "router")
    yield
    tracing.reset()


class _Replicas:
    def __init__(self, local: LocalRouterState) -> None:
        self.local = local

    @contextlib.asynccontextmanager
    async def choose_replica(self, target: Any, _reserve: bool = True) -> AsyncIterator[Any]:
        if isinstance(target, GenerateRequest):
            with route_span(target) as span:  # ours decides inside it and hands on its context
                pass
            ticket = RouteTicket(target.request_id, "r1", "affinity", 2, trace_context=span.carrier)
            with self.local.lock:
                self.local.record_ticket(ticket, 0.0, 600.0)
        replica_id = SimpleNamespace(unique_id="r1", to_full_id_str=lambda: "SERVE_REPLICA::a#r#r1")
        yield SimpleNamespace(_replica=SimpleNamespace(replica_id=replica_id))


class _Router(SimpleNamespace):
    """What ``RouterServer.route`` reads of the server."""

    async def _prepare(self, request: _HTTPRequest, trace_context: Any) -> GenerateRequest:
        if await request.body() == b"boom":
            raise RuntimeError("tokenizer bug")
        return GenerateRequest(
            "cmpl-1", tuple(range(10)), KEY, SamplingSettings(4), trace_context=trace_context
        )

    async def _choose(self, *args: Any, **kwargs: Any) -> Any:
        return await RouterServer._choose(self, *args, **kwargs)


class _HTTPRequest:
    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        self._body = body
        self.headers = headers

    async def body(self) -> bytes:
        return self._body


async def route(headers: Mapping[str, str], body: bytes = b"{}") -> dict[str, Any]:
    """HAProxy's call to the router; the answer's JSON."""
    local = LocalRouterState(registry=None)  # type: ignore[arg-type]
    router = _Router(_budget_s=5.0, _replicas=_Replicas(local), _local=local)
    router.routed = router.fallbacks = 0
    response = await RouterServer.route(router, _HTTPRequest(body, headers))
    answer: dict[str, Any] = json.loads(response.body)
    return answer


def serve_on_replica(answer: dict[str, Any], client_headers: Mapping[str, str]) -> None:
    """The replica's side: its parent from the ticket and the client's headers, its spans."""
    ticket = RouteTicket.from_headers(answer.get("request_headers", {}))
    context = trace_parent(ticket.trace_context if ticket else None, client_headers)
    request = GenerateRequest("cmpl-1", (1, 2), KEY, SamplingSettings(1), trace_context=context)
    trace = replica_trace(request, "r1")
    trace.queued(None, 0.0)
    trace.first_token(0)
    trace.end(1, "length")


def spans() -> dict[str, dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for span in tracing.finished_spans():
        assert span["name"] not in by_name, f"two {span['name']} spans"
        by_name[span["name"]] = span
    return by_name


async def test_client_router_decision_replica_is_one_trace() -> None:
    # HAProxy forwards the client's traceparent to the router under Serve's session header.
    answer = await route({**CLIENT, "x-request-id": "h1"})
    serve_on_replica(answer, {**CLIENT, "host": "127.0.0.1"})

    by_name = spans()
    call, decision = by_name["prefixmesh.router.request"], by_name["prefixmesh.route"]
    generate = by_name["prefixmesh.replica.generate"]
    assert {s["trace_id"] for s in by_name.values()} == {CLIENT_TRACE}
    assert call["parent_span_id"] == CLIENT_SPAN
    assert decision["parent_span_id"] == call["span_id"]
    assert generate["parent_span_id"] == decision["span_id"]  # through the ticket
    for phase in REPLICA_SPANS[1:]:
        assert by_name[f"prefixmesh.replica.{phase}"]["parent_span_id"] == generate["span_id"]
    assert call["attributes"]["prefixmesh.replica"] == "r1"
    assert generate["links"] == []


async def test_a_router_that_did_not_see_the_client_is_linked_from_its_trace() -> None:
    answer = await route({"x-request-id": "h1"})  # HAProxy set up without the session header
    serve_on_replica(answer, CLIENT)

    by_name = spans()
    call, decision = by_name["prefixmesh.router.request"], by_name["prefixmesh.route"]
    generate = by_name["prefixmesh.replica.generate"]
    assert call["parent_span_id"] is None and call["trace_id"] != CLIENT_TRACE
    assert decision["trace_id"] == call["trace_id"]
    assert (generate["trace_id"], generate["parent_span_id"]) == (CLIENT_TRACE, CLIENT_SPAN)
    (link,) = generate["links"]
    assert (link["trace_id"], link["span_id"]) == (decision["trace_id"], decision["span_id"])


async def test_a_failed_decision_still_answers_and_the_replica_follows_the_client() -> None:
    answer = await route(CLIENT, b"boom")
    assert answer == {"replica_id": "SERVE_REPLICA::a#r#r1"}  # a load-balanced pick, no ticket
    serve_on_replica(answer, CLIENT)

    by_name = spans()
    call = by_name["prefixmesh.router.request"]
    assert "prefixmesh.route" not in by_name
    assert call["parent_span_id"] == CLIENT_SPAN
    assert call["attributes"]["prefixmesh.fallback_reason"] == "error"
    assert [e["name"] for e in call["events"]] == ["exception"]
    generate = by_name["prefixmesh.replica.generate"]
    assert (generate["trace_id"], generate["parent_span_id"]) == (CLIENT_TRACE, CLIENT_SPAN)
