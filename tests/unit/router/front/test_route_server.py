"""The direct path's router answers HAProxy with the replica and the ticket: the digest of the
request's key, the hold only for the replica it chose, and no claim (it releases its claims
itself, through its ledger). A fake replica handle stands in for Serve's."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.core.ledger import LedgerLoad
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.router.front.route_server import RouterServer
from prefixmesh.wire import GenerateRequest, Hold, LoadBalanced, SamplingSettings
from prefixmesh.wire.route_ticket import RouteTicket, key_digest

KEY = BlockHasher(4, "m").hash_tokens(list(range(10)))


class _Replicas:
    """A replica handle whose request router leaves a decision for ``routed_to`` in the shared
    state, as ours does (``serve_router``), and whose pick is ``chosen`` (Serve may take a
    lower rank of the decision's)."""

    def __init__(self, chosen: str, routed_to: str, local: LocalRouterState | None = None) -> None:
        self.chosen = chosen
        self.routed_to = routed_to
        self.local = local

    @contextlib.asynccontextmanager
    async def choose_replica(self, target: Any, _reserve: bool = True) -> AsyncIterator[Any]:
        assert _reserve is False
        self.target = target
        if isinstance(target, GenerateRequest) and self.routed_to:
            assert self.local is not None, "a decision needs the state it is left in"
            ticket = RouteTicket(target.request_id, self.routed_to, "hold", 2, hold=Hold(2, 0.25))
            with self.local.lock:
                self.local.record_ticket(ticket, 0.0, 600.0)
        replica_id = SimpleNamespace(
            unique_id=self.chosen, to_full_id_str=lambda: f"SERVE_REPLICA::app#r#{self.chosen}"
        )
        yield SimpleNamespace(_replica=SimpleNamespace(replica_id=replica_id))


def _router(chosen: str, routed_to: str) -> Any:
    local = LocalRouterState(registry=None)  # type: ignore[arg-type]
    replicas = _Replicas(chosen, routed_to, local)
    return SimpleNamespace(_replicas=replicas, _local=local, routed=0, fallbacks=0)


async def answer(chosen: str, routed_to: str) -> tuple[dict[str, Any], RouteTicket | None]:
    router = _router(chosen, routed_to)
    generate = GenerateRequest("cmpl-1", tuple(range(10)), KEY, SamplingSettings(4))
    response = await RouterServer._choose(router, generate, 7)
    assert router._local.pending_tickets == 0  # taken
    body: dict[str, Any] = json.loads(response.body)
    return body, RouteTicket.from_headers(body.get("request_headers", {}))


async def test_the_ticket_names_the_replica_the_key_s_digest_and_no_claim() -> None:
    body, ticket = await answer("r1", "r1")
    assert body["replica_id"] == "SERVE_REPLICA::app#r#r1"
    assert ticket is not None
    assert (ticket.request_id, ticket.replica_id, ticket.reason) == ("cmpl-1", "r1", "hold")
    assert (ticket.matched_blocks, ticket.arrived_ns) == (2, 7)
    assert ticket.key_digest == key_digest(KEY)
    assert ticket.hold == Hold(2, 0.25)
    assert not any("claim" in name for name in body["request_headers"])


async def test_a_hold_decided_for_another_replica_is_not_sent() -> None:
    # Serve took another replica than the one the decision chose.
    _, ticket = await answer("r2", "r1")
    assert ticket is not None and ticket.replica_id == "r2" and ticket.hold is None


async def test_a_decision_cut_short_keeps_the_request_s_id_for_the_replica_to_end() -> None:
    """The deadline struck after the decision was recorded: the balanced pick carries the
    request's id, so the replica that serves it ends the ledger entry (regression: the entry
    counted for 600 s and test_direct_path's ledger never emptied), and the entry moves to it."""
    router = _router("r2", "")
    local, replicas = router._local, router._replicas
    local.ledger.routed("cmpl-1", ReplicaId("r1"), 10, now_s=0.0)
    cut_short = GenerateRequest("cmpl-1", tuple(range(10)), KEY, SamplingSettings(4))
    response = await RouterServer._choose(router, None, 7, abandoned=cut_short, why="timeout")
    body = json.loads(response.body)
    ticket = RouteTicket.from_headers(body["request_headers"])
    assert isinstance(replicas.target, LoadBalanced) and router.fallbacks == 1
    assert ticket is not None
    assert (ticket.request_id, ticket.replica_id, ticket.reason) == (
        "cmpl-1",
        "r2",
        "fallback_timeout",
    )
    assert (ticket.matched_blocks, ticket.hold, ticket.key_digest) == (0, None, key_digest(KEY))
    assert local.ledger.load() == {ReplicaId("r2"): LedgerLoad(1, 0, 10)}


async def test_a_decision_that_came_before_the_cut_leaves_only_its_trace_context() -> None:
    """The request router decided, then the deadline struck: its ticket is taken (nothing is
    left behind), the balanced pick's ticket keeps the decision's span as the replica's parent
    and nothing else of it (its hold was meant for another replica's prefill)."""
    router = _router("r2", "")
    decision = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    late = RouteTicket("cmpl-1", "r1", "hold", 2, hold=Hold(2, 0.25), trace_context=decision)
    with router._local.lock:
        router._local.record_ticket(late, 0.0, 600.0)
    cut_short = GenerateRequest("cmpl-1", tuple(range(10)), KEY, SamplingSettings(4))
    response = await RouterServer._choose(router, None, 7, abandoned=cut_short, why="timeout")
    ticket = RouteTicket.from_headers(json.loads(response.body)["request_headers"])
    assert ticket is not None and ticket.trace_context == decision
    assert (ticket.replica_id, ticket.reason, ticket.hold, ticket.matched_blocks) == (
        "r2",
        "fallback_timeout",
        None,
        0,
    )
    assert router._local.pending_tickets == 0


async def test_a_request_the_request_router_fell_back_on_gets_a_bare_ticket() -> None:
    """No decision left in the shared state (the request router fell back to power of two):
    the ticket names the pick and nothing decided."""
    _, ticket = await answer("r2", "")
    assert ticket is not None
    assert (ticket.replica_id, ticket.reason, ticket.matched_blocks, ticket.hold) == (
        "r2",
        "",
        0,
        None,
    )
    assert ticket.key_digest == key_digest(KEY)


async def test_a_request_never_decided_is_balanced_without_a_ticket() -> None:
    router = _router("r2", "")
    response = await RouterServer._choose(router, None, 7)
    assert json.loads(response.body) == {"replica_id": "SERVE_REPLICA::app#r#r2"}
