"""Ray Serve LLM's PrefixCacheAffinityRouter, in blocks instead of characters.

Ray's rule (``prefix_aware_router.py``), per request:

1. If the spread of ongoing requests over the candidates, max - min, exceeds
   ``imbalanced_threshold`` (10), route by power of two choices.
2. Else match the prompt against the router's own routing history (a multi-tenant prefix tree
   filled in ``on_request_routed``; no eviction by default). ``match_rate`` = matched / prompt
   length. Below ``match_rate_threshold`` (0.1) the candidates are the "smallest tenants" (least
   recorded in the tree), else the tenants with the longest match.
3. Serve sends to the shortest queue among those candidates.

Ray matches characters of the prompt text; here the history records block-hash chains and the
rate is matched blocks / (prompt_tokens / block_size). KV events (``view.hits``) are ignored:
Ray's router does not see them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import RayPrefixConfig
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.history_tree import RoutingHistoryTree
from prefixmesh.router.policy.load import (
    QuietHooks,
    chain_blocks,
    least_loaded_at_random,
    ongoing_loads,
    power_of_two,
    ranked,
    require_replicas,
)


class RayPrefixPolicy(QuietHooks):
    name = "ray_prefix"

    def __init__(self, config: RayPrefixConfig, *, rng: random.Random, block_size: int) -> None:
        self._imbalanced_threshold = config.imbalanced_threshold
        self._match_rate_threshold = config.match_rate_threshold
        self._block_size = block_size
        self._rng = rng
        self.tree = RoutingHistoryTree(max_blocks_per_tenant=None)

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        loads = ongoing_loads(replicas)
        if max(loads) - min(loads) > self._imbalanced_threshold:
            return RouteDecision(power_of_two(replicas, loads, self._rng), reason="imbalanced")
        chain = request.key.block_hashes
        matched = [self.tree.match(s.replica_id, chain) for s in replicas]
        longest = max(matched)
        prompt_blocks = chain_blocks(request.prompt_tokens, self._block_size)
        match_rate = longest / prompt_blocks if prompt_blocks > 0 else 0.0
        if match_rate < self._match_rate_threshold:
            sizes = [self.tree.size(s.replica_id) for s in replicas]
            smallest = min(sizes)
            candidates = [i for i, size in enumerate(sizes) if size == smallest]
            reason = "smallest_tenant"
        else:
            candidates = [i for i, blocks in enumerate(matched) if blocks == longest]
            reason = "prefix_match"
        chosen = least_loaded_at_random(loads, candidates, self._rng)
        rest = sorted((i for i in candidates if i != chosen), key=loads.__getitem__)
        return RouteDecision(ranked(replicas[i].replica_id for i in (chosen, *rest)), reason=reason)

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        self.tree.insert(replica, request.key.block_hashes)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.tree.remove(replica)
