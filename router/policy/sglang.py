"""SGLang router's ``cache_aware`` policy, in blocks instead of characters.

SGLang's rule (``cache_aware.rs``), per request, with loads = ongoing requests:

1. Imbalanced iff ``max - min > balance_abs_threshold`` AND ``max > balance_rel_threshold *
   min``: route to the least-loaded worker.
2. Else match the prompt against the router's own approximate tree; ``match_rate`` = matched /
   prompt length. Above ``cache_threshold``: the worker with the longest match (ties: lower
   load). Else the least-loaded worker (the shipped code; its docs still say "smallest tree",
   the path behind sgl-project/sglang#14305).
3. Insert the prompt under the chosen worker, whichever path chose it.
4. Evict each worker's least recently used leaves down to ``max_tree_size`` (SGLang does this
   on a background timer; here right after each insert, which only makes it tighter).

The insert happens in ``on_routed``, right after the decision, so a replica the adapter had to
fall back to is the one recorded. A tie in load goes to the first worker in candidate order,
like Rust's ``min_by_key``. KV events (``view.hits``) are ignored: SGLang does not see them.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import SGLangConfig
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.history_tree import RoutingHistoryTree
from prefixmesh.router.policy.load import (
    QuietHooks,
    by_load_after,
    chain_blocks,
    first_least_loaded,
    ongoing_loads,
    require_replicas,
)


class SGLangPolicy(QuietHooks):
    name = "sglang"

    def __init__(self, config: SGLangConfig, *, block_size: int) -> None:
        self._abs_threshold = config.balance_abs_threshold
        self._rel_threshold = config.balance_rel_threshold
        self._cache_threshold = config.cache_threshold
        self._block_size = block_size
        self.tree = RoutingHistoryTree(max_blocks_per_tenant=config.max_tree_blocks)

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        loads = ongoing_loads(replicas)
        highest, lowest = max(loads), min(loads)
        if highest - lowest > self._abs_threshold and highest > self._rel_threshold * lowest:
            chosen = first_least_loaded(loads)
            return RouteDecision(by_load_after(chosen, replicas, loads), reason="imbalanced")
        chain = request.key.block_hashes
        matched = [self.tree.match(s.replica_id, chain) for s in replicas]
        longest = max(matched)
        prompt_blocks = chain_blocks(request.prompt_tokens, self._block_size)
        match_rate = longest / prompt_blocks if prompt_blocks > 0 else 0.0
        if match_rate > self._cache_threshold:
            best = [i for i, blocks in enumerate(matched) if blocks == longest]
            chosen = first_least_loaded(loads, best)
            return RouteDecision(by_load_after(chosen, replicas, loads), reason="prefix_match")
        chosen = first_least_loaded(loads)
        return RouteDecision(by_load_after(chosen, replicas, loads), reason="least_loaded")

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        self.tree.insert(replica, request.key.block_hashes)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.tree.remove(replica)
