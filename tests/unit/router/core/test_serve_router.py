"""The Serve request router around the policy, built through its constructor with fake
replicas and no Ray cluster: a retry avoids the replica that failed it, the decision reaches
the replica as a ticket on its own copy of the request (the caller's never changes) and the
caller takes it from the shared state, and a Redis that does not answer delays neither the
router's start nor its first decision (B4)."""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixKey,
    ReplicaId,
    Tier,
)
from prefixmesh.config import load_config
from prefixmesh.router.core.decide import _lookup_outcome
from prefixmesh.router.core.serve_router import PrefixmeshRequestRouter
from prefixmesh.wire import (
    GenerateRequest,
    LoadBalanced,
    ReplicaReport,
    RouteTicket,
    SamplingSettings,
)
from tests.unit.router.core.test_metrics import samples

BLOCK = 128
BLOCKS = tuple(BlockHash(100 + i) for i in range(4))


def fake_replica(name: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_router(*overrides: str, clock: Clock | None = None) -> PrefixmeshRequestRouter:
    """Built as Serve builds it (the constructor, then ``initialize_state``), with no
    controller: nothing the hooks under test touch needs one."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    config = load_config(overrides=[f"app_name=test-{uuid.uuid4().hex[:8]}", *overrides])
    router = PrefixmeshRequestRouter(
        deployment_id=DeploymentID("replica", config.app_name),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state(config_json=config.model_dump_json(), clock=clock or Clock())
    return router


def sent(call: Any) -> GenerateRequest:
    """What Serve sends the chosen replica: the call's argument after routing."""
    [request] = call.args
    assert isinstance(request, GenerateRequest)
    return request


def taken(router: PrefixmeshRequestRouter, request: GenerateRequest) -> RouteTicket | None:
    with router._local.lock:
        return router._local.take_ticket(request.request_id)


def request_for(blocks: tuple[BlockHash, ...], avoid: tuple[str, ...] = ()) -> GenerateRequest:
    tokens = tuple(range(len(blocks) * BLOCK + 5))
    key = PrefixKey(blocks, BLOCK)
    return GenerateRequest(
        f"cmpl-{uuid.uuid4().hex}", tokens, key, SamplingSettings(4), avoid_replicas=avoid
    )


def pending(request: GenerateRequest) -> Any:
    return SimpleNamespace(args=[request], kwargs={})


def hold_prefix(router: PrefixmeshRequestRouter, replica: str) -> None:
    event = CacheEvent(EventKind.STORED, ReplicaId(replica), 0, 1, Tier.GPU, BLOCKS)
    router._local.registry.publish([event])


async def test_the_holder_is_chosen_and_the_decision_sent_as_its_ticket() -> None:
    router = make_router()
    replicas = [fake_replica("r1"), fake_replica("r2"), fake_replica("r3")]
    hold_prefix(router, "r2")
    request = request_for(BLOCKS)
    call = pending(request)
    ranked = await router.choose_replicas(replicas, call)
    assert ranked[0][0].replica_id.unique_id == "r2"
    ticket = sent(call).ticket
    assert ticket is not None
    assert (ticket.request_id, ticket.replica_id) == (request.request_id, "r2")
    assert ticket.matched_blocks == len(BLOCKS) and ticket.reason != ""
    assert dataclasses.replace(sent(call), ticket=None) == request  # nothing else differs
    assert request.ticket is None  # the caller's request is never changed
    assert taken(router, request) == ticket  # the caller's channel: taken once
    assert taken(router, request) is None


async def test_a_retry_avoids_the_replica_that_failed_it() -> None:
    router = make_router()
    replicas = [fake_replica("r1"), fake_replica("r2"), fake_replica("r3")]
    hold_prefix(router, "r2")
    request = request_for(BLOCKS, avoid=("r2",))
    call = pending(request)
    ranked = await router.choose_replicas(replicas, call)
    chosen = {r.replica_id.unique_id for tier in ranked for r in tier}
    assert "r2" not in chosen
    ticket = sent(call).ticket
    assert ticket is not None and ticket.replica_id in {"r1", "r3"}
    assert ticket.matched_blocks == 0
    assert taken(router, request) == ticket


async def test_a_request_routed_again_carries_the_latest_decision() -> None:
    """Serve routes a refused request again with the same pending request: the second
    decision replaces the first, in the call and in the shared state."""
    router = make_router()
    hold_prefix(router, "r2")
    request = request_for(BLOCKS)
    call = pending(request)
    await router.choose_replicas([fake_replica("r1"), fake_replica("r2")], call)
    await router.choose_replicas([fake_replica("r1"), fake_replica("r3")], call)
    ticket = sent(call).ticket
    assert ticket is not None and ticket.replica_id in {"r1", "r3"}
    assert taken(router, request) == ticket
    assert router._local.pending_tickets == 0


async def test_a_ticket_nobody_takes_goes_after_the_request_timeout() -> None:
    clock = Clock()
    router = make_router("ingress.request_timeout_s=30", clock=clock)
    abandoned, later = request_for(BLOCKS), request_for(BLOCKS)
    await router.choose_replicas([fake_replica("r1")], pending(abandoned))
    clock.now_s += 30  # still within the timeout
    await router.choose_replicas([fake_replica("r1")], pending(later))
    assert router._local.pending_tickets == 2
    clock.now_s += 0.5  # the first one is past it
    await router.choose_replicas([fake_replica("r1")], pending(request_for(BLOCKS)))
    assert taken(router, abandoned) is None
    assert taken(router, later) is not None


async def test_an_avoided_replica_is_still_used_when_it_is_the_only_one() -> None:
    router = make_router()
    request = request_for(BLOCKS, avoid=("r1",))
    ranked = await router.choose_replicas([fake_replica("r1")], pending(request))
    assert ranked[0][0].replica_id.unique_id == "r1"


async def test_a_hung_registry_delays_neither_the_start_nor_the_first_decision(
    silent_server: int,
) -> None:
    router = make_router(
        "registry.backend=redis",
        f"registry.redis_url=redis://127.0.0.1:{silent_server}/0",
        "registry.lookup_deadline_ms=5",
        # Connect waits up to 4 op timeouts for a hung server: 40 s, so that a loaded machine
        # cannot end it before the checks below (at 250 ms it sometimes did).
        "registry.op_timeout_ms=10000",
    )
    # The client exists, connecting in the background: the router's start awaited nothing.
    connecting = router._core._connecting
    assert router._core.registry is not None
    assert connecting is not None and not connecting.done()
    key = PrefixKey(BLOCKS, BLOCK)
    view = await router._core.registry_view(key, [ReplicaId("r1")], None)
    assert view.hits == {}
    assert not connecting.done()  # the first decision did not wait for the connect either
    fallbacks = samples(router._metrics.render())
    timed_out = fallbacks[("prefixmesh_routing_fallbacks_total", (("reason", "registry_timeout"),))]
    unavailable = fallbacks[
        ("prefixmesh_routing_fallbacks_total", (("reason", "registry_unavailable"),))
    ]
    assert timed_out + unavailable == 1
    await router._core.registry.close()


@pytest.mark.parametrize(
    ("hits", "elapsed_s", "available", "failed", "outcome"),
    [
        ({ReplicaId("r"): object()}, 0.001, True, False, "ok"),
        ({}, 0.001, True, False, "empty"),
        ({}, 0.0049, True, True, "timeout"),
        ({}, 0.0001, True, True, "unavailable"),  # refused at once, or not verified yet
        ({}, 0.0, False, True, "unavailable"),  # backing off after a failure
    ],
)
def test_lookup_outcomes(
    hits: dict[ReplicaId, Any], elapsed_s: float, available: bool, failed: bool, outcome: str
) -> None:
    assert _lookup_outcome(hits, elapsed_s, 0.005, available, failed) == outcome


async def test_a_call_without_a_prompt_goes_to_the_less_loaded_of_two() -> None:
    router = make_router()
    busy, idle = fake_replica("busy"), fake_replica("idle")
    busy.routing_stats = {"queued_requests": 3, "running_requests": 2}
    idle.routing_stats = {"queued_requests": 0, "running_requests": 1}
    call = SimpleNamespace(args=[LoadBalanced()], kwargs={})
    for _ in range(5):  # the pair is random; with two candidates it is always both
        ranked = await router.choose_replicas([busy, idle], call)
        assert [r.replica_id.unique_id for r in ranked[0]] == ["idle", "busy"]


def test_the_direct_path_counts_a_report_plus_what_no_report_lists_yet() -> None:
    """No Serve callback says when a request finished on the direct path, and with a shared
    registry no replica tells this router either: a replica's report counts what reached it,
    the ledger what was routed since and not yet listed."""
    from prefixmesh.router.core.decide import Candidate

    router = make_router("registry.backend=redis")  # serving.path=direct, the default
    core, local = router._core, router._local
    with local.lock:
        local.ledger.routed("arrived", ReplicaId("r1"), 500, now_s=router._clock())
        local.ledger.routed("on-its-way", ReplicaId("r1"), 300, now_s=router._clock())
    report = ReplicaReport(1, 2, 500, seen_requests=("arrived", "finished-earlier"))
    [snapshot] = core.snapshots([Candidate(ReplicaId("r1"), report)])
    assert (snapshot.queued_requests, snapshot.running_requests) == (2, 2)
    assert snapshot.pending_prefill_tokens == 800
    assert len(local.ledger) == 1


def test_the_direct_path_with_replicas_progress_counts_the_ledger_alone() -> None:
    """With the in-process registry the replicas say when requests reach their first token and
    end: the ledger is exact, and a report a second old (still counting what has finished
    since) is not added to it."""
    from prefixmesh.router.core.decide import Candidate
    from prefixmesh.wire.request_progress import RequestProgress

    router = make_router()  # direct path, in-process registry: the defaults
    core, local = router._core, router._local
    with local.lock:
        local.ledger.routed("running", ReplicaId("r1"), 500, now_s=router._clock())
        local.ledger.routed("on-its-way", ReplicaId("r1"), 300, now_s=router._clock())
        local.apply_progress(RequestProgress("r1", ("running",), ()))
    stale = ReplicaReport(3, 4, 900, seen_requests=("running", "finished-since"))
    [snapshot] = core.snapshots([Candidate(ReplicaId("r1"), stale)])
    assert (snapshot.queued_requests, snapshot.running_requests) == (1, 1)
    assert snapshot.pending_prefill_tokens == 300
    assert len(local.ledger) == 2
