"""The replica's spans (generate -> queue, prefill, decode) with a fake engine and the SDK's
in-memory exporter: no Serve."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from prefixmesh import tracing
from prefixmesh.cache_registry.types import BlockHash, PrefixKey, ReplicaId
from prefixmesh.config import TelemetryConfig
from prefixmesh.replica.admission.fair_gate import FairGate
from prefixmesh.replica.admission.holds import HoldSettings, ReplicaHolds
from prefixmesh.replica.engines.base import EngineChunk, EngineRequest
from prefixmesh.replica.serving.deployment import ReplicaCore
from prefixmesh.replica.serving.spans import LINKED, NO_TRACE, replica_trace, trace_parent
from prefixmesh.wire import GenerateRequest, Hold, ReplicaCapacity, RouteTicket, SamplingSettings
from tests.unit.replica.conftest import sim_config

R = ReplicaId("replica-a")
KEY = PrefixKey(tuple(BlockHash(7 + i) for i in range(2)), 128)


class _Engine:
    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.notices: list[tuple[str, str]] = []

    def announce(self, request_id: str, blocks: object) -> None:
        self.notices.append(("waiting", request_id))

    def withdraw(self, request_id: str) -> None:
        self.notices.append(("left", request_id))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        for i in range(3):
            await asyncio.sleep(0.002)
            if self.fail_after is not None and i >= self.fail_after:
                raise ConnectionError("engine went away")
            last = i == 2
            yield EngineChunk((i,), last, "length" if last else None, num_cached_tokens=128)

    def capacity(self) -> ReplicaCapacity:
        return ReplicaCapacity(
            prefill_tokens_per_s=10_000.0, decode_step_s=0.01, max_batch_tokens=2048, kv_blocks=100
        )

    def close(self) -> None:
        pass


class _NoPublisher:
    """The event publisher of a replica whose engine reports no changes."""

    def submit(self, changes: object) -> None:
        raise AssertionError("the fake engine changes nothing")


def _server(engine: _Engine, fair: FairGate | None = None) -> ReplicaCore:
    """The replica's core, no Serve: the fake engine, its own holds, no coalescing."""
    return ReplicaCore(
        sim_config("replica.coalesce_stream=false"),
        R,
        engine,  # type: ignore[arg-type]
        _NoPublisher(),  # type: ignore[arg-type]
        holds=ReplicaHolds(HoldSettings(own_holds=True)),
        fair=fair,
    )


def _request(
    hold: Hold | None = None,
    trace_context: dict[str, str] | None = None,
    routed_to: str = R,
) -> GenerateRequest:
    return GenerateRequest(
        "cmpl-1",
        tuple(range(2 * 128 + 3)),
        KEY,
        SamplingSettings(3),
        ticket=RouteTicket("cmpl-1", routed_to, "affinity", hold=hold),
        trace_context=trace_context,
        tenant="team-a",
        priority=-1,
    )


async def _drain(server: ReplicaCore, request: GenerateRequest) -> list[Any]:
    return [chunk async for chunk in server.generate(request)]


@pytest.fixture
def memory() -> Iterator[None]:
    tracing.reset()
    tracing.setup(TelemetryConfig(tracing="memory"), "replica")
    yield
    tracing.reset()


async def test_generate_spans_are_children_of_the_route_span(memory: None) -> None:
    route = tracing.tracer().start_span("prefixmesh.route")
    request = _request(Hold(num_blocks=2, max_wait_s=0.5), tracing.inject(route))
    route.end()

    chunks = await _drain(_server(_Engine()), request)

    assert len(chunks) == 3
    spans = {s["name"]: s for s in tracing.finished_spans()}
    root = spans["prefixmesh.replica.generate"]
    assert root["parent_span_id"] == spans["prefixmesh.route"]["span_id"]
    assert root["kind"] == "SERVER"
    for phase in ("queue", "prefill", "decode"):
        span = spans[f"prefixmesh.replica.{phase}"]
        assert span["parent_span_id"] == root["span_id"]
        assert span["trace_id"] == root["trace_id"]
    queue, prefill, decode = (
        spans[f"prefixmesh.replica.{p}"] for p in ("queue", "prefill", "decode")
    )
    assert root["start_ns"] <= queue["end_ns"] <= prefill["start_ns"]
    assert prefill["end_ns"] <= decode["start_ns"] <= decode["end_ns"] <= root["end_ns"]
    assert [e["name"] for e in prefill["events"]] == ["first_token"]
    assert root["attributes"] == {
        "prefixmesh.request_id": "cmpl-1",
        "prefixmesh.replica": "replica-a",
        "prefixmesh.prompt_tokens": 259,
        "prefixmesh.tenant": "team-a",
        "prefixmesh.priority": -1,
        "prefixmesh.hold": True,
        "prefixmesh.hold_s": pytest.approx(0.0, abs=0.05),
        "prefixmesh.hold_blocks": 2,
        "prefixmesh.hold_max_wait_s": 0.5,
        "prefixmesh.cached_tokens": 128,
        "prefixmesh.output_tokens": 3,
        "prefixmesh.finish_reason": "length",
    }
    assert queue["attributes"]["prefixmesh.hold_blocks"] == 2


async def test_a_held_request_records_the_time_it_waited(memory: None) -> None:
    server = _server(_Engine())
    server.holds.inflight.started("other", KEY, 256)  # another request is computing the prefix
    request = _request(Hold(num_blocks=2, max_wait_s=0.05))
    await _drain(server, request)
    queue = next(s for s in tracing.finished_spans() if s["name"] == "prefixmesh.replica.queue")
    assert queue["attributes"]["prefixmesh.hold_s"] >= 0.04  # waited out the bound


async def test_an_engine_failure_ends_every_span_with_an_error(memory: None) -> None:
    with pytest.raises(ConnectionError):
        await _drain(_server(_Engine(fail_after=1)), _request())
    spans = {s["name"]: s for s in tracing.finished_spans()}
    assert set(spans) == {
        "prefixmesh.replica.generate",
        "prefixmesh.replica.queue",
        "prefixmesh.replica.prefill",
        "prefixmesh.replica.decode",
    }
    assert spans["prefixmesh.replica.generate"]["status"] == "ERROR"
    assert spans["prefixmesh.replica.generate"]["parent_span_id"] is None  # no context sent


async def test_a_closed_stream_is_marked_cancelled(memory: None) -> None:
    stream = _server(_Engine()).generate(_request())
    await stream.__anext__()
    await stream.aclose()  # the ingress stopped reading (a stop string, a client went away)
    root = next(s for s in tracing.finished_spans() if s["name"] == "prefixmesh.replica.generate")
    assert root["attributes"]["prefixmesh.cancelled"] is True
    assert root["status"] == "UNSET"


async def test_tracing_off_costs_no_spans() -> None:
    tracing.reset()
    request = _request()
    assert replica_trace(request, R) is NO_TRACE
    assert len(await _drain(_server(_Engine()), request)) == 3
    assert tracing.finished_spans() == []


# ---- the direct path's parent: the router's ticket and the client's headers ------------------

CLIENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
DECISION = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"}
"""The router's decision in the client's trace (HAProxy forwarded the client's header)."""
OTHER_DECISION = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
"""A decision in a trace of the router's own (HAProxy did not forward the client's header)."""


def test_the_decision_is_the_parent_when_it_continues_the_client(memory: None) -> None:
    assert trace_parent(DECISION, CLIENT) == DECISION
    assert trace_parent(DECISION, {}) == DECISION  # the client sent none: the router's trace
    assert trace_parent(DECISION, {"traceparent": "junk"}) == DECISION


def test_without_a_decision_the_client_is_the_parent(memory: None) -> None:
    assert trace_parent(None, {**CLIENT, "host": "x"}) == CLIENT  # a direct call, a blind pick
    assert trace_parent({"traceparent": "junk"}, CLIENT) == CLIENT
    assert trace_parent(None, {"traceparent": "junk"}) is None
    assert trace_parent(None, {}) is None


def test_a_decision_in_another_trace_is_linked_from_the_client_s(memory: None) -> None:
    state = {"tracestate": "vendor=1"}
    parent = trace_parent(OTHER_DECISION, {**CLIENT, **state})
    assert parent == {**CLIENT, **state, LINKED: OTHER_DECISION["traceparent"]}

    request = _request(trace_context=parent)
    trace = replica_trace(request, R)
    trace.end(0, None)
    spans = {s["name"]: s for s in tracing.finished_spans()}
    root = spans["prefixmesh.replica.generate"]
    assert root["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert root["parent_span_id"] == "b7ad6b7169203331"
    assert root["links"] == [
        {
            "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
            "span_id": "00f067aa0ba902b7",
            "attributes": {"prefixmesh.link": "route"},
        }
    ]


def test_tracing_off_has_no_parent() -> None:
    tracing.reset()
    assert trace_parent(DECISION, CLIENT) is None


async def test_a_request_the_decision_sent_elsewhere_names_that_replica(memory: None) -> None:
    request = _request(routed_to="replica-b")  # HAProxy redispatched it here
    await _drain(_server(_Engine()), request)
    root = next(s for s in tracing.finished_spans() if s["name"] == "prefixmesh.replica.generate")
    assert root["attributes"]["prefixmesh.routed_to"] == "replica-b"
    assert root["links"] == []
