"""The direct path's replica turns the router's ticket and its own key of the prompt into the
engine request: the key it hashed travels as it is, the router's hold only to the replica the
router chose, and no claim (the router releases its claims itself). ``DirectFront`` built
through its constructor over a fake replica; no Serve, no HTTP."""

from __future__ import annotations

from typing import Any

from prefixmesh.api.prepare import PreparedRequest
from prefixmesh.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.replica.serving.direct_front import DirectFront
from prefixmesh.wire import GenerateRequest, Hold, SamplingSettings
from prefixmesh.wire.route_ticket import RouteTicket, key_digest
from tests.fakes.front_door import prepared_only
from tests.unit.router.core.test_metrics import samples

ME = ReplicaId("replica-a")
IDS = tuple(range(10))
KEY = BlockHasher(4, "m").hash_tokens(list(IDS))
SAMPLING = SamplingSettings(4)


def prepared(chat: bool = False) -> PreparedRequest:
    """The front door's request for ``IDS`` (``api/prepare.py``)."""
    body = (
        ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")])
        if chat
        else CompletionRequest(model="m", prompt=list(IDS))
    )
    return PreparedRequest(body, chat, IDS, SAMPLING, KEY, tenant="team-a", priority=3)


class _Replica:
    """What ``_request`` reads of its replica: its id."""

    replica_id = ME


def server() -> DirectFront:
    return DirectFront(_Replica(), prepared_only(), decode=str)  # type: ignore[arg-type]  # only its id is read


def ticket(replica_id: str = ME, digest: str | None = None) -> RouteTicket:
    return RouteTicket(
        request_id="cmpl-router-1",
        replica_id=replica_id,
        reason="affinity",
        matched_blocks=2,
        key_digest=key_digest(KEY) if digest is None else digest,
        arrived_ns=1,
        hold=Hold(2, 0.25),
        trace_context={"traceparent": "00-ab-cd-01"},
    )


def counted(replica: Any, name: str) -> float:
    return samples(replica.metrics.render()).get((name, ()), 0.0)


def test_the_router_s_decision_and_the_replica_s_key_make_the_request() -> None:
    replica = server()
    parent = {"traceparent": "00-ab-cd-01"}  # trace_parent's choice (tests/unit/replica)
    request = replica._request(ticket(), prepared(), parent)
    assert request.key is KEY  # the hasher's key, not a tuple rebuilt from it
    assert request.ticket == ticket()  # the router's decision, as it came
    assert (request.request_id, request.hold) == ("cmpl-router-1", Hold(2, 0.25))
    assert request.trace_context == parent
    assert (request.tenant, request.priority) == ("team-a", 3)  # built once, not replaced
    assert not hasattr(request, "claim")
    for name in ("route_key_mismatches", "redispatched_requests", "unrouted_requests"):
        assert counted(replica, f"prefixmesh_{name}_total") == 0.0


def test_a_redispatched_request_waits_for_nothing_meant_for_another_replica() -> None:
    replica = server()
    request = replica._request(ticket(replica_id="replica-b"), prepared())
    assert request.ticket is not None
    assert (request.hold, request.ticket.matched_blocks) == (None, 0)
    assert (request.ticket.replica_id, request.ticket.reason) == ("replica-b", "affinity")
    assert counted(replica, "prefixmesh_redispatched_requests_total") == 1.0


def test_a_key_the_router_digested_otherwise_is_counted() -> None:
    replica = server()
    other = BlockHasher(4, "m").hash_tokens([9, *IDS[1:]])
    replica._request(ticket(digest=key_digest(other)), prepared())
    assert counted(replica, "prefixmesh_route_key_mismatches_total") == 1.0


def test_without_a_ticket_the_request_is_the_replica_s_own() -> None:
    replica = server()
    request = replica._request(None, prepared(chat=True))
    assert isinstance(request, GenerateRequest) and request.key is KEY
    assert request.request_id.startswith("chatcmpl-") and request.hold is None
    assert counted(replica, "prefixmesh_unrouted_requests_total") == 1.0
