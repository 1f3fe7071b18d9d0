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
from prefixmesh.router.route_server import RouterServer
from prefixmesh.wire import GenerateRequest, HoldInstruction, SamplingSettings
from prefixmesh.wire.route_ticket import RouteTicket, key_digest

KEY = BlockHasher(4, "m").hash_tokens(list(range(10)))


class _Replicas:
    """A replica handle whose request router picks ``chosen`` and writes its decision into the
    request, as ours does on the proxy path's adapter (``serve_router._carry``)."""

    def __init__(self, chosen: str, routed_to: str) -> None:
        self.chosen = chosen
        self.routed_to = routed_to

    @contextlib.asynccontextmanager
    async def choose_replica(self, target: Any, _reserve: bool = True) -> AsyncIterator[Any]:
        assert _reserve is False
        if isinstance(target, GenerateRequest):
            target.hold = HoldInstruction(2, 0.25)
            target.routed_by, target.routed_to, target.matched_blocks = "hold", self.routed_to, 2
        replica_id = SimpleNamespace(
            unique_id=self.chosen, to_full_id_str=lambda: f"SERVE_REPLICA::app#r#{self.chosen}"
        )
        yield SimpleNamespace(_replica=SimpleNamespace(replica_id=replica_id))


async def answer(chosen: str, routed_to: str) -> tuple[dict[str, Any], RouteTicket | None]:
    router = SimpleNamespace(_replicas=_Replicas(chosen, routed_to), routed=0, fallbacks=0)
    generate = GenerateRequest("cmpl-1", tuple(range(10)), KEY, SamplingSettings(4))
    response = await RouterServer._choose(router, generate, 7)
    body: dict[str, Any] = json.loads(response.body)
    return body, RouteTicket.from_headers(body.get("request_headers", {}))


async def test_the_ticket_names_the_replica_the_key_s_digest_and_no_claim() -> None:
    body, ticket = await answer("r1", "r1")
    assert body["replica_id"] == "SERVE_REPLICA::app#r#r1"
    assert ticket is not None
    assert (ticket.request_id, ticket.replica_id, ticket.reason) == ("cmpl-1", "r1", "hold")
    assert (ticket.matched_blocks, ticket.arrived_ns) == (2, 7)
    assert ticket.key_digest == key_digest(KEY)
    assert ticket.hold == HoldInstruction(2, 0.25)
    assert not any("claim" in name for name in body["request_headers"])


async def test_a_hold_decided_for_another_replica_is_not_sent() -> None:
    # Serve took another replica than the one the decision chose.
    _, ticket = await answer("r2", "r1")
    assert ticket is not None and ticket.replica_id == "r2" and ticket.hold is None
