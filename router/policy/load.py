"""Helpers every policy shares: the empty-fleet check, load reads, rankings, quiet hooks.

Loads here are Ray Serve's and SGLang's unit, ongoing requests (queued + running); the
prefixmesh policy estimates time instead (``ttft.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from prefixmesh.cache_registry.types import BlockHash, PrefixHit, ReplicaId
from prefixmesh.router.policy.base import ReplicaSnapshot, RouteRequest

Ranking = tuple[tuple[ReplicaId, ...], ...]


def require_replicas(replicas: Sequence[ReplicaSnapshot], policy: str) -> None:
    """Routing needs somewhere to go: the one input every policy refuses."""
    if not replicas:
        raise ValueError(f"{policy}: no candidate replicas to route to (the replica list is empty)")


def ranked(replica_ids: Iterable[ReplicaId]) -> Ranking:
    """One replica per tier, in order of preference: the adapter tries them one by one."""
    return tuple((replica_id,) for replica_id in replica_ids)


def ongoing_loads(replicas: Sequence[ReplicaSnapshot]) -> list[int]:
    return [snapshot.queued_requests + snapshot.running_requests for snapshot in replicas]


def first_least_loaded(loads: Sequence[int], among: Iterable[int] | None = None) -> int:
    """Index of the first minimum (Rust's ``min_by_key``, which SGLang uses)."""
    indices = range(len(loads)) if among is None else among
    return min(indices, key=loads.__getitem__)


def least_loaded_at_random(loads: Sequence[int], among: Sequence[int], rng: random.Random) -> int:
    """Index of a minimum among ``among``, ties at random (a queue probe does not prefer)."""
    lowest = min(loads[i] for i in among)
    tied = [i for i in among if loads[i] == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def by_load_after(first: int, replicas: Sequence[ReplicaSnapshot], loads: Sequence[int]) -> Ranking:
    """``first``, then every other replica from least to most loaded (stable)."""
    rest = sorted((i for i in range(len(replicas)) if i != first), key=loads.__getitem__)
    return ranked(replicas[i].replica_id for i in (first, *rest))


def power_of_two(
    replicas: Sequence[ReplicaSnapshot], loads: Sequence[int], rng: random.Random
) -> Ranking:
    """Ray Serve's default: two distinct replicas uniformly at random, fewer ongoing first.

    The sample's own order breaks a tie, which makes ties random.
    """
    if len(replicas) == 1:
        return ranked([replicas[0].replica_id])
    a, b = rng.sample(range(len(replicas)), 2)
    if loads[b] < loads[a]:
        a, b = b, a
    return ranked([replicas[a].replica_id, replicas[b].replica_id])


def chain_blocks(tokens: int, block_size: int) -> float:
    """A token count in blocks, fractional like the peers' character rates (never 0-divides)."""
    return tokens / block_size if block_size > 0 else 0.0


class QuietHooks:
    """Default hooks for policies that keep no state beyond their own decisions."""

    def prefix_group(self, request: RouteRequest) -> BlockHash | None:
        return None

    def traffic_weight(self, request: RouteRequest) -> float:
        return 0.0

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        return None

    def on_finished(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        return None

    def on_replica_removed(self, replica: ReplicaId) -> None:
        return None


def hit_tiers(hit: PrefixHit) -> tuple[int, int, int]:
    """Leading blocks held in (GPU, CPU, DISK); GPU includes speculative blocks.

    A hit built without ``blocks_by_tier`` (all zero) counts entirely as GPU, so a hand-built
    ``PrefixHit(num_blocks)`` means what it says.
    """
    _, cpu, disk = hit.blocks_by_tier
    return max(hit.num_blocks - cpu - disk, 0), cpu, disk
