"""The routing decision as it travels from router to replica: one ``RouteTicket``, on both paths.

The request router (``router/core/serve_router.py``) makes it from its decision; on the proxy path
it rides in ``GenerateRequest.ticket`` (the handle call's argument), and the ingress gets it back
through the state it shares with the request router (``LocalRouterState.take_ticket``). On the
direct path HAProxy asks our router (``/internal/route``) where a request goes, then
sets the headers of the router's answer on the request it forwards to that replica. Headers
under ``TRUSTED_PREFIX`` are Ray's router-owned namespace: HAProxy deletes client-sent ones
before the router is asked, so what the replica reads there came from the router.

The ticket carries what the replica cannot know by itself (the router's request id, the replica
it chose, matched blocks, hold, when the request entered the cluster, trace context) and a
digest of the prompt's key, so the replica can check that it keyed the prompt as the router did
(a mismatch means the two disagree on tokenizer or hashing, and routing is blind). A claim the
router took is not on it: the router releases its claims itself (``router/core/holds.py``).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from prefixmesh.cache_registry.types import PrefixKey

TRUSTED_PREFIX = "x-serve-router-"
"""Ray Serve's ``SERVE_INGRESS_ROUTER_HEADER_PREFIX``: HAProxy strips client-sent headers
with it, so only the router's answer sets them."""
_PREFIX = TRUSTED_PREFIX + "pm-"
_TRACE_FIELDS = ("traceparent", "tracestate")


def key_digest(key: PrefixKey) -> str:
    """A short digest of a prompt's key: its block hashes (both sides compute it the same
    way)."""
    packed = array("Q", [h & 0xFFFF_FFFF_FFFF_FFFF for h in key.block_hashes]).tobytes()
    return xxhash.xxh64_hexdigest(packed)


@dataclass(frozen=True, slots=True)
class Hold:
    """Delay-hit deferral: on the chosen replica, wait (at most ``max_wait_s``) until the first
    ``num_blocks`` blocks of the request are stored there, because another request on that
    replica is computing them right now; then run, and hit them. The one hold type: the
    policy decides it, the ticket carries it, the replica (or the simulated engine) waits it
    out."""

    num_blocks: int
    max_wait_s: float


@dataclass(frozen=True, slots=True)
class RouteTicket:
    request_id: str
    replica_id: str
    """The replica the router chose; HAProxy may redispatch to another one on a retry (and
    Serve may take a lower rank of the decision's on the proxy path)."""
    reason: str
    """The routing decision's reason, for metrics and response headers."""
    matched_blocks: int = 0
    """Leading prompt blocks the chosen replica holds (registry)."""
    key_digest: str = ""
    """The direct path's check of the prompt's key (``key_digest``); empty: not checked."""
    arrived_ns: int = 0
    """Wall-clock time the router received the request (direct path: TTFT is measured from
    there); 0: unknown."""
    hold: Hold | None = None
    trace_context: Mapping[str, str] | None = None
    """The routing decision's span context: the replica's spans are its children."""

    def headers(self) -> dict[str, str]:
        """Flat string headers (HAProxy's Lua parses a flat JSON map of strings)."""
        out = {
            _PREFIX + "request-id": self.request_id,
            _PREFIX + "replica": self.replica_id,
            _PREFIX + "reason": self.reason,
            _PREFIX + "matched-blocks": str(self.matched_blocks),
            _PREFIX + "key-digest": self.key_digest,
            _PREFIX + "arrived-ns": str(self.arrived_ns),
        }
        if self.hold is not None:
            out[_PREFIX + "hold"] = f"{self.hold.num_blocks}:{self.hold.max_wait_s:.6f}"
        for field in _TRACE_FIELDS:
            value = (self.trace_context or {}).get(field)
            if value:
                out[_PREFIX + field] = value
        return out

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> RouteTicket | None:
        """The ticket a router attached, or None when the request did not come through one
        (a direct call to the replica's port) or the headers do not parse."""
        request_id = headers.get(_PREFIX + "request-id")
        if not request_id:
            return None
        try:
            hold = None
            raw_hold = headers.get(_PREFIX + "hold")
            if raw_hold:
                blocks, wait_s = raw_hold.split(":", 1)
                hold = Hold(int(blocks), float(wait_s))
            trace = {f: headers[_PREFIX + f] for f in _TRACE_FIELDS if headers.get(_PREFIX + f)}
            return cls(
                request_id=request_id,
                replica_id=headers.get(_PREFIX + "replica", ""),
                reason=headers.get(_PREFIX + "reason", ""),
                matched_blocks=int(headers.get(_PREFIX + "matched-blocks", "0")),
                key_digest=headers.get(_PREFIX + "key-digest", ""),
                arrived_ns=int(headers.get(_PREFIX + "arrived-ns", "0")),
                hold=hold,
                trace_context=trace or None,
            )
        except ValueError:
            return None
