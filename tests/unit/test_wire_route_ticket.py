from __future__ import annotations

from prefixmesh.wire import HoldInstruction
from prefixmesh.wire.route_ticket import TRUSTED_PREFIX, RouteTicket, key_digest


def ticket(**changes: object) -> RouteTicket:
    fields: dict[str, object] = {
        "request_id": "cmpl-1",
        "replica_id": "abc123",
        "reason": "affinity",
        "matched_blocks": 3,
        "key_digest": key_digest([1, 2, 3]),
        "arrived_ns": 1_700_000_000_000_000_000,
        "hold": HoldInstruction(2, 0.25),
        "claim": 2**63 + 5,
        "trace_context": {"traceparent": "00-abc-def-01"},
    }
    fields.update(changes)
    return RouteTicket(**fields)  # type: ignore[arg-type]


def test_a_ticket_survives_the_trip_through_headers() -> None:
    original = ticket()
    headers = original.headers()
    # HAProxy deletes client-sent headers under Ray's router prefix: every field lives there.
    assert all(name.startswith(TRUSTED_PREFIX) for name in headers)
    assert all(isinstance(value, str) for value in headers.values())
    assert RouteTicket.from_headers(headers) == original


def test_optional_fields_stay_absent() -> None:
    bare = ticket(hold=None, claim=None, trace_context=None)
    headers = bare.headers()
    assert not any(name.endswith(("hold", "claim", "traceparent")) for name in headers)
    assert RouteTicket.from_headers(headers) == bare


def test_no_ticket_without_the_router_or_with_garbage() -> None:
    assert RouteTicket.from_headers({"content-type": "application/json"}) is None
    broken = ticket().headers()
    broken[TRUSTED_PREFIX + "pm-hold"] = "lots:of"
    assert RouteTicket.from_headers(broken) is None


def test_the_digest_depends_on_every_hash_and_their_order() -> None:
    assert key_digest([1, 2, 3]) == key_digest([1, 2, 3])
    assert key_digest([1, 2, 3]) != key_digest([3, 2, 1])
    assert key_digest([1, 2]) != key_digest([1, 2, 3])
    assert key_digest([]) == key_digest(())
