"""Tiny routing policies for simulator tests (the real ones live in router/policy/)."""

from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.cache_registry.types import BlockHash, ReplicaId
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)


class _Base:
    name = "base"

    def prefix_group(self, request: RouteRequest) -> BlockHash | None:
        return request.key.block_hashes[0] if request.key.block_hashes else None

    def traffic_weight(self, request: RouteRequest) -> float:
        return 1.0

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        pass

    def on_finished(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        pass

    def on_replica_removed(self, replica: ReplicaId) -> None:
        pass


class RoundRobin(_Base):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        chosen = replicas[self.next % len(replicas)].replica_id
        self.next += 1
        return RouteDecision(((chosen,),), reason="rr")


class LongestHit(_Base):
    """Most registry-held blocks, then fewest ongoing requests; optionally holds on speculative
    (in-flight) hits."""

    name = "longest_hit"

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        def score(s: ReplicaSnapshot) -> tuple[int, int, str]:
            hit = view.hits.get(s.replica_id)
            return (-(hit.num_blocks if hit else 0), s.ongoing_requests, s.replica_id)

        best = min(replicas, key=score)
        hit = view.hits.get(best.replica_id)
        hold = None
        if self.hold_s and hit is not None and hit.num_speculative:
            hold = Hold(hit.num_blocks, self.hold_s)
        return RouteDecision(((best.replica_id,),), hold=hold, reason="hit")
