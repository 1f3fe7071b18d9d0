"""NVIDIA Dynamo's KV router cost function (``router-concepts.md``), lowest cost wins.

    raw_prefill_blocks      = active_prefill_blocks + incoming_prompt_blocks
    adjusted_prefill_blocks = max(raw_prefill_blocks - overlap_credit_blocks, 0)
    decode_blocks           = active_decode_blocks + incoming_active_blocks
    cost = prefill_load_scale * adjusted_prefill_blocks + decode_blocks

The replica-side terms come from the snapshot: active prefill = ``pending_prefill_tokens`` /
block_size, active decode = ``active_kv_blocks``. The request adds its prompt blocks to prefill
and its prompt + output blocks to decode. Overlap credit = GPU blocks x 1.0 + CPU x 0.75 + disk
x 0.25 from the registry's hit (a speculative block counts as GPU, like Dynamo's predicted
index). Temperature 0: argmin, ties at random (ai-dynamo/dynamo#3581).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from prefixmesh.config import DynamoConfig
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.load import QuietHooks, hit_tiers, ranked, require_replicas


class DynamoPolicy(QuietHooks):
    name = "dynamo"

    def __init__(self, config: DynamoConfig, *, rng: random.Random, block_size: int) -> None:
        self._config = config
        self._block_size = block_size
        self._rng = rng

    def costs(
        self, request: RouteRequest, replicas: Sequence[ReplicaSnapshot], view: RegistryView
    ) -> list[float]:
        config = self._config
        block_size = self._block_size
        prompt_blocks = request.prompt_tokens / block_size
        request_blocks = (request.prompt_tokens + request.output_tokens) / block_size
        costs = []
        for snapshot in replicas:
            raw_prefill = snapshot.pending_prefill_tokens / block_size + prompt_blocks
            hit = view.hits.get(snapshot.replica_id)
            credit = 0.0
            if hit is not None:
                gpu, cpu, disk = hit_tiers(hit)
                credit = (
                    gpu * config.gpu_overlap_credit
                    + cpu * config.cpu_overlap_credit
                    + disk * config.disk_overlap_credit
                )
            adjusted_prefill = max(raw_prefill - credit, 0.0)
            decode = snapshot.active_kv_blocks + request_blocks
            costs.append(config.prefill_load_scale * adjusted_prefill + decode)
        return costs

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        costs = self.costs(request, replicas, view)
        lowest = min(costs)
        tied = [i for i, cost in enumerate(costs) if cost == lowest]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        rest = sorted((i for i in range(len(replicas)) if i != chosen), key=costs.__getitem__)
        return RouteDecision(
            ranked(replicas[i].replica_id for i in (chosen, *rest)), reason="lowest_cost"
        )
