"""The cache-blind baselines: round robin and power of two choices (Ray Serve's default)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.load import (
    QuietHooks,
    ongoing_loads,
    power_of_two,
    ranked,
    require_replicas,
)


class RoundRobinPolicy(QuietHooks):
    """Each call takes the next replica of the candidate list, cycling (Ray's RoundRobinRouter).

    The cursor indexes the list as given, so a fleet change shifts the cycle, as in Ray; the
    ranking is the whole list rotated to start at the chosen replica.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        start = self._cursor % len(replicas)
        self._cursor = start + 1
        order = [*replicas[start:], *replicas[:start]]
        return RouteDecision(ranked(s.replica_id for s in order), reason="round_robin")


class PowerOfTwoPolicy(QuietHooks):
    """Two distinct replicas sampled uniformly; the one with fewer ongoing requests first."""

    name = "pow2"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        ranking = power_of_two(replicas, ongoing_loads(replicas), self._rng)
        return RouteDecision(ranking, reason="pow2")
