"""The Serve request router around the policy, with fake replicas and no Ray cluster: a retry
avoids the replica that failed it, the decision is written into the request, and a Redis that
does not answer delays neither the router's start nor its first decision (B4)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
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
from prefixmesh.router.decide import _lookup_outcome
from prefixmesh.router.serve_router import PrefixmeshRequestRouter
from prefixmesh.wire import GenerateRequest, LoadBalanced, ReplicaReport, SamplingSettings
from tests.unit.router.test_metrics import samples

BLOCK = 128
BLOCKS = tuple(BlockHash(100 + i) for i in range(4))


def fake_replica(name: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})


def make_router(*overrides: str) -> PrefixmeshRequestRouter:
    # Serve's base __init__ needs a controller; the hooks under test need only our state.
    config = load_config(overrides=[f"app_name=test-{uuid.uuid4().hex[:8]}", *overrides])
    router = PrefixmeshRequestRouter.__new__(PrefixmeshRequestRouter)
    router._lazily_fetched_loop = None
    router.initialize_state(config_json=config.model_dump_json())
    return router


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


async def test_the_holder_is_chosen_and_the_decision_written_into_the_request() -> None:
    router = make_router()
    replicas = [fake_replica("r1"), fake_replica("r2"), fake_replica("r3")]
    hold_prefix(router, "r2")
    request = request_for(BLOCKS)
    ranked = await router.choose_replicas(replicas, pending(request))
    assert ranked[0][0].replica_id.unique_id == "r2"
    assert request.routed_to == "r2"
    assert request.matched_blocks == len(BLOCKS)


async def test_a_retry_avoids_the_replica_that_failed_it() -> None:
    router = make_router()
    replicas = [fake_replica("r1"), fake_replica("r2"), fake_replica("r3")]
    hold_prefix(router, "r2")
    request = request_for(BLOCKS, avoid=("r2",))
    ranked = await router.choose_replicas(replicas, pending(request))
    chosen = {r.replica_id.unique_id for tier in ranked for r in tier}
    assert "r2" not in chosen
    assert request.routed_to in {"r1", "r3"}
    assert request.matched_blocks == 0


async def test_an_avoided_replica_is_still_used_when_it_is_the_only_one() -> None:
    router = make_router()
    request = request_for(BLOCKS, avoid=("r1",))
    ranked = await router.choose_replicas([fake_replica("r1")], pending(request))
    assert ranked[0][0].replica_id.unique_id == "r1"


@pytest.fixture
async def silent_server() -> AsyncIterator[int]:
    """A TCP server that accepts connections and never answers: a hung Redis."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    for writer in held:
        writer.close()
    server.close()


async def test_a_hung_registry_delays_neither_the_start_nor_the_first_decision(
    silent_server: int,
) -> None:
    started = time.perf_counter()
    router = make_router(
        "registry.backend=redis",
        f"registry.redis_url=redis://127.0.0.1:{silent_server}/0",
        "registry.lookup_deadline_ms=5",
    )
    assert time.perf_counter() - started < 0.5  # nothing awaited (connect waits up to 1 s)
    assert router._core.registry is not None  # the client exists, connecting in the background
    key = PrefixKey(BLOCKS, BLOCK)
    started = time.perf_counter()
    view = await router._core.registry_view(key, [ReplicaId("r1")], None)
    took_s = time.perf_counter() - started
    assert view.hits == {}
    # The lookup deadline plus slack for a loaded 2-core machine, far below connect's 1 s.
    assert took_s < 0.005 + 0.1, took_s
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
    from prefixmesh.router.decide import Candidate

    router = make_router("registry.backend=redis")  # serving.path=direct, the default
    core, local = router._core, router._local
    with local.lock:
        local.ledger.routed("arrived", ReplicaId("r1"), 500, now_s=time.monotonic())
        local.ledger.routed("on-its-way", ReplicaId("r1"), 300, now_s=time.monotonic())
    report = ReplicaReport(1, 2, 500, seen_requests=("arrived", "finished-earlier"))
    [snapshot] = core.snapshots([Candidate(ReplicaId("r1"), report)])
    assert (snapshot.queued_requests, snapshot.running_requests) == (2, 2)
    assert snapshot.pending_prefill_tokens == 800
    assert len(local.ledger) == 1


def test_the_direct_path_with_replicas_progress_counts_the_ledger_alone() -> None:
    """With the in-process registry the replicas say when requests reach their first token and
    end: the ledger is exact, and a report a second old (still counting what has finished
    since) is not added to it."""
    from prefixmesh.router.decide import Candidate
    from prefixmesh.wire.request_progress import RequestProgress

    router = make_router()  # direct path, in-process registry: the defaults
    core, local = router._core, router._local
    with local.lock:
        local.ledger.routed("running", ReplicaId("r1"), 500, now_s=time.monotonic())
        local.ledger.routed("on-its-way", ReplicaId("r1"), 300, now_s=time.monotonic())
        local.apply_progress(RequestProgress("r1", ("running",), ()))
    stale = ReplicaReport(3, 4, 900, seen_requests=("running", "finished-since"))
    [snapshot] = core.snapshots([Candidate(ReplicaId("r1"), stale)])
    assert (snapshot.queued_requests, snapshot.running_requests) == (1, 1)
    assert snapshot.pending_prefill_tokens == 300
    assert len(local.ledger) == 2
