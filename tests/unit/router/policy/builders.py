"""Tiny hand-built snapshots, requests and views for policy tests (block size 4)."""

from __future__ import annotations

import random

from prefixmesh.cache_registry.types import BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.config import RoutingConfig
from prefixmesh.router.policy import make_policy
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteRequest,
    RoutingPolicy,
)

BLOCK_SIZE = 4

CAPACITY = ReplicaCapacity(
    prefill_tokens_per_s=1000.0, decode_step_s=0.01, max_batch_tokens=100, kv_blocks=1000
)
"""Budget 100 tokens per step of 0.1 s: prefill at 1,000 tokens/s when nothing decodes."""


def rid(name: str) -> ReplicaId:
    return ReplicaId(name)


def snap(
    name: str,
    *,
    queued: int = 0,
    running: int = 0,
    pending: int = 0,
    kv: int = 0,
    capacity: ReplicaCapacity = CAPACITY,
    pending_attention_s: float = 0.0,
) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        ReplicaId(name),
        capacity,
        queued_requests=queued,
        running_requests=running,
        pending_prefill_tokens=pending,
        active_kv_blocks=kv,
        pending_attention_s=pending_attention_s,
    )


def fleet(*names: str, **loads: int) -> list[ReplicaSnapshot]:
    return [snap(name, **loads) for name in names]


def chain(*blocks: int) -> tuple[BlockHash, ...]:
    """Chained-looking hashes: block i of a prompt whose blocks are ``blocks`` gets a hash that
    names blocks[0..i] (distinct prefixes, distinct hashes)."""
    return tuple(BlockHash(hash(blocks[: i + 1]) & 0xFFFF_FFFF_FFFF) for i in range(len(blocks)))


def request(
    *blocks: int, extra_tokens: int = 0, output: int = 0, request_id: str = "q"
) -> RouteRequest:
    """A prompt of ``len(blocks)`` full blocks (plus ``extra_tokens`` in a partial block)."""
    key = PrefixKey(chain(*blocks), BLOCK_SIZE)
    return RouteRequest(request_id, key, len(blocks) * BLOCK_SIZE + extra_tokens, output)


def hit(gpu: int = 0, cpu: int = 0, disk: int = 0, speculative: int = 0) -> PrefixHit:
    return PrefixHit(gpu + cpu + disk, (gpu, cpu, disk), speculative)


def view(group_rate: float = 0.0, **hits: PrefixHit) -> RegistryView:
    return RegistryView({ReplicaId(name): h for name, h in hits.items()}, group_rate)


def policy(name: str, seed: int = 0, **section: object) -> RoutingPolicy:
    """``make_policy`` with overrides of the policy's own config section."""
    config = RoutingConfig.model_validate({name: section} if section else {})
    return make_policy(name, config, rng=random.Random(seed), block_size=BLOCK_SIZE)


def chosen_ids(ranked: tuple[tuple[ReplicaId, ...], ...]) -> list[str]:
    return [str(replica) for tier in ranked for replica in tier]
