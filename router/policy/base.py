"""The routing-policy seam: a pure, synchronous decision from snapshots and a registry view.

A policy never does I/O. The adapter around it (the Ray Serve request router, or the cluster
simulator) gathers replica snapshots and a ``RegistryView``, calls ``route``, then carries out
what the decision asks for (send, hold, write speculative entries, touch the group's hotness).
Time arrives as ``now_s``; randomness comes from the ``random.Random`` the policy was built with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixmesh.cache_registry.types import (
    SHARED_TIER,
    BlockHash,
    PrefixHit,
    PrefixKey,
    ReplicaId,
)

# What replicas report (the wire type), re-exported: policies weigh replicas by it.
from prefixmesh.wire.replica_report import ReplicaCapacity as ReplicaCapacity

# The hold a decision asks for is the one the replica receives (the wire type), re-exported.
from prefixmesh.wire.route_ticket import Hold as Hold


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """A replica's load as the router sees it now (reported stats plus what it routed since)."""

    replica_id: ReplicaId
    capacity: ReplicaCapacity
    queued_requests: int = 0
    """Accepted, not yet admitted to the running batch (held requests included)."""
    running_requests: int = 0
    pending_prefill_tokens: int = 0
    """Prompt tokens routed to it that still have to be computed (queued and in progress)."""
    active_kv_blocks: int = 0
    """KV blocks held by its running requests (prompt and generated tokens)."""
    pending_attention_s: float = 0.0
    """What the attention of that pending prefill adds to it (``ReplicaReport``'s)."""

    @property
    def ongoing_requests(self) -> int:
        return self.queued_requests + self.running_requests


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    key: PrefixKey
    """Chained hashes of the prompt's full blocks."""
    prompt_tokens: int
    output_tokens: int
    """Expected output length (max_tokens, or a trace's output length) for load estimates."""


@dataclass(frozen=True, slots=True)
class RegistryView:
    """What the registry said about this request, fetched by the adapter before ``route``."""

    hits: Mapping[ReplicaId, PrefixHit] = field(default_factory=dict)
    """Leading blocks each candidate holds (confirmed or speculative); absent = none."""
    group_rate: float = 0.0
    """Decayed traffic of the request's prefix group (``RoutingPolicy.prefix_group``), in
    ``traffic_weight`` units per second; 0 when unknown."""
    shared_blocks: int = 0
    """Leading blocks the cluster's shared tier holds: any replica can load them (at its
    ``ReplicaCapacity.shared_load_s_per_block``) instead of computing them."""


def registry_view(hits: Mapping[ReplicaId, PrefixHit], group_rate: float = 0.0) -> RegistryView:
    """The view of a lookup that asked for ``SHARED_TIER`` too: its hit becomes
    ``shared_blocks``, the rest are the replicas' own."""
    shared = hits.get(SHARED_TIER)
    if shared is None:
        return RegistryView(hits, group_rate)
    own = {replica: hit for replica, hit in hits.items() if replica != SHARED_TIER}
    return RegistryView(own, group_rate, shared.num_blocks)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    ranked: tuple[tuple[ReplicaId, ...], ...]
    """Candidates in ranked tiers; the adapter tries the first replica of the first tier first
    (Ray Serve's RequestRouter contract). Never empty when there is at least one replica."""
    hold: Hold | None = None
    """Applies to ``chosen`` only: an adapter that falls back to a later replica drops it."""
    reason: str = ""
    """A short label for metrics and traces: "affinity", "least_ttft", "overload", ..."""
    expected_ttft_s: float | None = None
    """The policy's estimate of the time until ``chosen`` sends the first token, which is when
    it holds the prompt's blocks (None: no estimate). The routing-time registry entries live
    this much longer than ``registry.speculative_ttl_s``, so that siblings of a long prefill
    still find it in flight."""

    @property
    def chosen(self) -> ReplicaId:
        return self.ranked[0][0]

    def speculative_ttl_s(self, base_s: float) -> float:
        """How long the routing-time registry entries for this decision live: ``base_s`` (the
        replica's events' lag) past the expected first token."""
        expected = self.expected_ttft_s
        if expected is not None and 0 < expected < math.inf:
            return base_s + expected
        return base_s


class RoutingPolicy(Protocol):
    """A routing rule. Implementations keep only state that follows from their own decisions
    (a routing-time prefix tree, router-side load counters) and are not thread-safe."""

    name: str

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision: ...

    def prefix_group(self, request: RouteRequest) -> BlockHash | None:
        """The group whose traffic this policy wants in ``view.group_rate`` (None: none)."""
        ...

    def traffic_weight(self, request: RouteRequest) -> float:
        """What one request adds to its group's decayed traffic counter."""
        ...

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        """The request was sent to ``replica``."""
        ...

    def on_finished(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        """The request completed (or failed) on ``replica``."""
        ...

    def on_replica_removed(self, replica: ReplicaId) -> None:
        """The replica is gone; forget it."""
        ...
