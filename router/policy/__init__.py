"""Routing policies: pure, synchronous rules behind one interface (``base.RoutingPolicy``).

``make_policy`` builds one by name for the Ray Serve request router and the cluster simulator.
"""

from __future__ import annotations

import random

from prefixmesh.config import RoutingConfig
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from prefixmesh.router.policy.dynamo import DynamoPolicy
from prefixmesh.router.policy.prefix_hash import PrefixHashPolicy
from prefixmesh.router.policy.prefixmesh_policy import PrefixmeshPolicy
from prefixmesh.router.policy.ray_prefix import RayPrefixPolicy
from prefixmesh.router.policy.sglang import SGLangPolicy
from prefixmesh.router.policy.simple import PowerOfTwoPolicy, RoundRobinPolicy

POLICY_NAMES: tuple[str, ...] = (
    "round_robin",
    "pow2",
    "prefix_hash",
    "ray_prefix",
    "sglang",
    "dynamo",
    "prefixmesh",
)


def make_policy(
    name: str, config: RoutingConfig, *, rng: random.Random, block_size: int
) -> RoutingPolicy:
    """A fresh policy called ``name``, set up from its section of ``config``.

    ``rng`` is its only source of randomness (seed it for reproducible runs); ``block_size``
    must be the engine's, the unit of every prefix key the policy will see.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "pow2":
        return PowerOfTwoPolicy(rng)
    if name == "prefix_hash":
        return PrefixHashPolicy(config.prefix_hash, block_size=block_size)
    if name == "ray_prefix":
        return RayPrefixPolicy(config.ray_prefix, rng=rng, block_size=block_size)
    if name == "sglang":
        return SGLangPolicy(config.sglang, block_size=block_size)
    if name == "dynamo":
        return DynamoPolicy(config.dynamo, rng=rng, block_size=block_size)
    if name == "prefixmesh":
        return PrefixmeshPolicy(config.prefixmesh, rng=rng, block_size=block_size)
    raise ValueError(f"unknown routing policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")


__all__ = [
    "POLICY_NAMES",
    "Hold",
    "RegistryView",
    "ReplicaCapacity",
    "ReplicaSnapshot",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
