"""The ingress's /metrics text: every family the router and the ingress keep, with its labels."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixmesh.api.generation import Generation
from prefixmesh.api.request_metrics import RequestMetrics as IngressMetrics
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.router.core.metrics import RouterMetrics
from prefixmesh.wire import GenerateChunk, GenerateRequest, Hold, RouteTicket, SamplingSettings


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


class _Stream:
    def __init__(self, chunks: list[GenerateChunk]) -> None:
        self._chunks = chunks

    async def __anext__(self) -> GenerateChunk:
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)

    def cancel(self) -> None:
        pass


def test_every_family_renders_with_its_labels() -> None:
    router, ingress = RouterMetrics(), IngressMetrics()
    router.decided("prefixmesh", "hit", 6, "gpu", hold=False, seconds=0.0004)
    router.decided("prefixmesh", "hold", 3, "cpu", hold=True, seconds=0.002)
    router.decided("prefixmesh", "hit", 0, "none", hold=False, seconds=0.0001)
    router.looked_up("redis", "ok", 0.0003)
    router.looked_up("redis", "timeout", 0.006)
    router.fell_back("registry_timeout")
    router.saw_load("r1", queued=2, running=3, pending_tokens=1500)
    router.ongoing.set(4)
    ingress.retried("before_first_token", "ActorDiedError")
    ingress.stream_errors.inc()

    got = samples(ingress.render(router.registry))

    assert (
        got[("prefixmesh_routing_decisions_total", (("policy", "prefixmesh"), ("reason", "hit")))]
        == 2
    )
    assert (
        got[("prefixmesh_routing_decisions_total", (("policy", "prefixmesh"), ("reason", "hold")))]
        == 1
    )
    assert got[("prefixmesh_routing_matched_blocks_count", (("tier", "gpu"),))] == 1
    assert got[("prefixmesh_routing_matched_blocks_sum", (("tier", "gpu"),))] == 6
    assert got[("prefixmesh_routing_matched_blocks_bucket", (("le", "4.0"), ("tier", "cpu")))] == 1
    assert got[("prefixmesh_routing_matched_blocks_count", (("tier", "none"),))] == 1
    assert got[("prefixmesh_routing_decision_seconds_count", ())] == 3
    assert got[("prefixmesh_routing_holds_total", ())] == 1
    ok = (("backend", "redis"), ("outcome", "ok"))
    assert got[("prefixmesh_registry_lookup_seconds_count", ok)] == 1
    timed_out = (("backend", "redis"), ("le", "0.005"), ("outcome", "timeout"))
    assert got[("prefixmesh_registry_lookup_seconds_bucket", timed_out)] == 0
    # Every fallback reason has a series from the start: zero means none happened.
    assert got[("prefixmesh_routing_fallbacks_total", (("reason", "error"),))] == 0
    assert got[("prefixmesh_routing_fallbacks_total", (("reason", "registry_unavailable"),))] == 0
    assert got[("prefixmesh_routing_fallbacks_total", (("reason", "registry_timeout"),))] == 1
    load = {
        field: got[("prefixmesh_replica_load", (("field", field), ("replica", "r1")))]
        for field in ("queued", "running", "pending_prefill_tokens")
    }
    assert load == {"queued": 2, "running": 3, "pending_prefill_tokens": 1500}
    assert got[("prefixmesh_router_ongoing_requests", ())] == 4
    retried = (("error", "ActorDiedError"), ("phase", "before_first_token"))
    assert got[("prefixmesh_request_retries_total", retried)] == 1
    assert got[("prefixmesh_stream_errors_total", ())] == 1
    assert ("prefixmesh_ttft_seconds_count", ()) in got


def test_a_replica_that_left_stops_being_reported() -> None:
    router, ingress = RouterMetrics(), IngressMetrics()
    router.saw_load("r1", 1, 1, 10)
    router.saw_load("r2", 0, 0, 0)
    router.forget_replica("r1")
    router.forget_replica("r1")  # twice (two Serve hooks can report one death): harmless
    text = ingress.render(router.registry)
    assert 'replica="r1"' not in text
    assert 'replica="r2"' in text


async def test_hold_time_comes_from_the_first_chunk() -> None:
    ingress = IngressMetrics()
    ticket = RouteTicket("cmpl-1", "r1", "hold", hold=Hold(1, 0.5))
    request = GenerateRequest(
        "cmpl-1", (1, 2, 3), PrefixKey((), 16), SamplingSettings(4), ticket=ticket
    )
    chunk = GenerateChunk((7,), num_cached_tokens=2, replica_id="r1", held_s=0.03)
    generation = Generation(
        _Stream([chunk]), lambda ids: "x", 3, [], lambda: None, lambda: None, request=request
    )
    await generation.first()
    ingress.first_token(generation)
    got = samples(ingress.render(RouterMetrics().registry))
    assert got[("prefixmesh_hold_seconds_count", ())] == 1
    assert got[("prefixmesh_hold_seconds_sum", ())] == 0.03
    assert got[("prefixmesh_cached_prompt_tokens_total", ())] == 2
    assert generation.routed_to == "r1"


async def test_routed_to_falls_back_to_the_routers_choice() -> None:
    """No chunk came back: the replica to avoid is the one the request router chose, taken
    once from the state it shares with the ingress, before the generation closes."""
    request = GenerateRequest("cmpl-1", (1,), PrefixKey((), 16), SamplingSettings(1))
    asked: list[str] = []

    def routed() -> RouteTicket:
        asked.append("routed")
        return RouteTicket("cmpl-1", "r9", "affinity", 3)

    generation = Generation(
        _Stream([]),
        lambda ids: "",
        1,
        [],
        lambda: None,
        lambda: asked.append("end"),
        request=request,
        routed=routed,
    )
    assert generation.routed_to == ""  # not known before the first output
    await generation.first()
    assert generation.routed_to == "r9"
    assert generation.ticket is not None and generation.ticket.matched_blocks == 3
    assert asked == ["routed"]
    generation.close()
    assert asked == ["routed", "end"]


async def test_the_router_s_choice_is_known_when_the_call_fails_before_any_output() -> None:
    request = GenerateRequest("cmpl-1", (1,), PrefixKey((), 16), SamplingSettings(1))
    asked: list[str] = []

    class _Failing:
        async def __anext__(self) -> Any:
            raise ConnectionError("replica died")

        def cancel(self) -> None:
            pass

    generation = Generation(
        _Failing(),
        lambda ids: "",
        1,
        [],
        lambda: None,
        lambda: asked.append("end"),
        request=request,
        routed=lambda: RouteTicket("cmpl-1", "r9", "affinity"),
    )
    with pytest.raises(ConnectionError):
        await generation.first()
    assert generation.routed_to == "r9" and asked == ["end"]
