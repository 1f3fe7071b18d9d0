"""The direct path's routing decision as it travels: trusted headers from router to replica.

On the direct path HAProxy asks our router (``/internal/route``) where a request goes, then
sets the headers of the router's answer on the request it forwards to that replica. Headers
under ``TRUSTED_PREFIX`` are Ray's router-owned namespace: HAProxy deletes client-sent ones
before the router is asked, so what the replica reads there came from the router.

The ticket carries what the replica cannot know by itself (the router's request id, the replica
it chose, matched blocks, hold, when the request entered the cluster, trace context) and a
digest of the prompt's key, so the replica can check that it keyed the prompt as the router did
(a mismatch means the two disagree on tokenizer or hashing, and routing is blind). A claim the
router took is not on it: the router releases its claims itself (``router/holds.py``).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.wire import HoldInstruction

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
class RouteTicket:
    request_id: str
    replica_id: str
    """The replica the router chose; HAProxy may redispatch to another one on a retry."""
    reason: str
    matched_blocks: int
    key_digest: str
    arrived_ns: int
    """Wall-clock time the router received the request: TTFT is measured from there."""
    hold: HoldInstruction | None = None
    trace_context: Mapping[str, str] | None = None

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
                hold = HoldInstruction(int(blocks), float(wait_s))
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
