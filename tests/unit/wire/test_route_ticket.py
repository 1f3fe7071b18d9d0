from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash, PrefixKey
from prefixmesh.wire import Hold
from prefixmesh.wire.route_ticket import TRUSTED_PREFIX, RouteTicket, key_digest


def key(*hashes: int, block_size: int = 16) -> PrefixKey:
    return PrefixKey(tuple(BlockHash(h) for h in hashes), block_size)


def ticket(**changes: object) -> RouteTicket:
    fields: dict[str, object] = {
        "request_id": "cmpl-1",
        "replica_id": "abc123",
        "reason": "affinity",
        "matched_blocks": 3,
        "key_digest": key_digest(key(1, 2, 3)),
        "arrived_ns": 1_700_000_000_000_000_000,
        "hold": Hold(2, 0.25),
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
    bare = ticket(hold=None, trace_context=None)
    headers = bare.headers()
    assert not any(name.endswith(("hold", "traceparent")) for name in headers)
    assert RouteTicket.from_headers(headers) == bare


def test_no_ticket_without_the_router_or_with_garbage() -> None:
    assert RouteTicket.from_headers({"content-type": "application/json"}) is None
    broken = ticket().headers()
    broken[TRUSTED_PREFIX + "pm-hold"] = "lots:of"
    assert RouteTicket.from_headers(broken) is None


def test_no_claim_travels() -> None:
    # The router releases its claims itself (its ledger): none travels to the replica, and a
    # stray claim header is ignored.
    headers = ticket().headers()
    assert not any("claim" in name for name in headers)
    headers[TRUSTED_PREFIX + "pm-claim"] = "12345"
    assert RouteTicket.from_headers(headers) == ticket()


def test_the_digest_depends_on_every_hash_and_their_order() -> None:
    assert key_digest(key(1, 2, 3)) == key_digest(key(1, 2, 3))
    assert key_digest(key(1, 2, 3)) != key_digest(key(3, 2, 1))
    assert key_digest(key(1, 2)) != key_digest(key(1, 2, 3))
    assert key_digest(key()) == key_digest(key(block_size=4))


def test_the_digest_is_the_one_routers_and_replicas_computed_before() -> None:
    # xxh64 of the hashes as unsigned 64-bit words: a router and a replica of different
    # versions still agree (the block size is not part of it).
    assert key_digest(key(1, 2, 3)) == "8799e152e5c0cdfa"
    assert key_digest(key(1, 2, 3, block_size=128)) == "8799e152e5c0cdfa"
    assert key_digest(key()) == "ef46db3751d8e999"
    assert key_digest(key(2**64 - 1, 5)) == "f2b9a4b7f34337cd"


def test_the_request_carries_the_decision_as_one_value_and_cannot_be_changed() -> None:
    """The proxy path's decision rides in ``GenerateRequest.ticket``, pickled with the handle
    call; nobody writes a decision into a caller's request (it is frozen)."""
    import dataclasses
    import pickle

    import pytest

    from prefixmesh.wire import GenerateRequest, SamplingSettings

    bare = GenerateRequest("cmpl-1", (1, 2, 3), key(1), SamplingSettings(4))
    assert bare.ticket is None and bare.hold is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        bare.ticket = ticket()  # type: ignore[misc]
    routed = dataclasses.replace(bare, ticket=ticket())
    arrived = pickle.loads(pickle.dumps(routed))
    assert arrived == routed and arrived.ticket == ticket()
    assert arrived.hold == Hold(2, 0.25)
