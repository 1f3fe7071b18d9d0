"""``PrefixmeshRequestRouter``: the Ray Serve ``RequestRouter`` that runs our routing policies.

Serve calls ``choose_replicas`` in the ingress process (on the router's own event loop) for
every call on the replica handle. For a ``GenerateRequest`` it builds replica snapshots (the
replicas' reported stats, raised by this router's own ledger), asks the registry what each
candidate holds (within ``lookup_deadline_ms``), lets the policy decide, sets the request's hold,
and records speculative entries and the group's traffic. Any error falls back to power of two:
an exception inside a request router would hang the request (DESIGN.md §7), so nothing escapes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from prefixmesh.cache_registry.factory import make_memory_state, make_registry
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.types import BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.ledger import LedgerLoad
from prefixmesh.router.local_state import LocalRouterState, local_state
from prefixmesh.router.policy import make_policy
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from prefixmesh.wire import GenerateRequest, HoldInstruction

logger = logging.getLogger(__name__)


def capacity_from_stats(stats: dict[str, Any], default: ReplicaCapacity) -> ReplicaCapacity:
    raw = stats.get("capacity") or {}
    try:
        return ReplicaCapacity(
            prefill_tokens_per_s=float(
                raw.get("prefill_tokens_per_s", default.prefill_tokens_per_s)
            ),
            decode_step_s=float(raw.get("decode_step_s", default.decode_step_s)),
            max_batch_tokens=int(raw.get("max_batch_tokens", default.max_batch_tokens)),
            kv_blocks=int(raw.get("kv_blocks", default.kv_blocks)) or default.kv_blocks,
            tp_degree=int(raw.get("tp_degree", default.tp_degree)),
            cpu_load_s_per_block=float(raw.get("cpu_load_s_per_block", 0.0)),
            disk_load_s_per_block=float(raw.get("disk_load_s_per_block", 0.0)),
        )
    except (TypeError, ValueError):
        return default


class PrefixmeshRequestRouter(RequestRouter):
    def initialize_state(self, config_json: str = "{}", **_: Any) -> None:
        self._config = PrefixmeshConfig.model_validate_json(config_json)
        config = self._config
        self._local: LocalRouterState = local_state(
            config.app_name, lambda: make_memory_state(config)
        )
        with self._local.lock:
            self._local.stats_source = self
        self._policy: RoutingPolicy = make_policy(
            config.routing.policy,
            config.routing,
            rng=random.Random(),
            block_size=config.cache.block_size,
        )
        vllm = config.replica.vllm
        self._default_capacity = ReplicaCapacity(
            prefill_tokens_per_s=vllm.prefill_tokens_per_s,
            decode_step_s=vllm.decode_step_s,
            max_batch_tokens=vllm.max_num_batched_tokens,
            kv_blocks=1,
            tp_degree=vllm.tensor_parallel_size,
        )
        self._deadline_s = config.registry.lookup_deadline_ms / 1000
        self._sole_router = config.ingress.num_replicas == 1
        self._remote: CacheRegistry | None = None  # the Redis client, made on the router loop
        self._background: set[asyncio.Task[Any]] = set()
        self._rng = random.Random()

    # ---- Serve hooks -----------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        try:
            return await self._choose(candidate_replicas, pending_request)
        except Exception:
            logger.exception("routing failed; falling back to power of two")
            with self._local.lock:
                self._local.counters.fallbacks += 1
            return self._power_of_two(candidate_replicas)

    def _get_pending_request_matching_metadata(self, request_metadata: Any = None) -> Any:
        # NOTE: Serve's base class hands the replica chosen for a request to the OLDEST pending
        # request unless a mixin matches metadata (only MultiplexMixin does). Our decisions are
        # per request (its prefix, its hold), so the replica must go to the request it was
        # chosen for. Serve's internal request id does not tell requests apart (calls made
        # while serving one HTTP request share it), so match the metadata object itself.
        # Without this, concurrent requests swap replicas and a request pinned to one replica
        # (an admin call) can spin forever.
        if request_metadata is None:
            return None
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(ReplicaId(replica_id.unique_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Serve calls this whenever its replica set changes: scale-down, a redeploy, a replica
        # replaced after failing health checks. A replica that left takes its registry entries
        # with it, or routers would keep sending its prefixes to replicas that never see them.
        known = getattr(self, "_replica_id_set", set())
        current = {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        for gone in known - current:
            self._forget(ReplicaId(gone.unique_id))

    def _forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left from the policy, the ledger and the registry."""
        try:
            self._policy.on_replica_removed(replica)
            with self._local.lock:
                self._local.ledger.forget_replica(replica)
                if self._config.registry.backend == "memory":
                    self._local.registry.drop_replica(replica)
            if self._config.registry.backend != "memory":
                self._spawn(self._drop_remote(replica))
        except Exception:
            logger.exception("forgetting replica %s failed", replica)

    async def _drop_remote(self, replica: ReplicaId) -> None:
        registry = await self._remote_registry()
        await registry.drop_replica(replica)

    # ---- the decision ----------------------------------------------------------------------

    async def _choose(
        self, candidates: list[RunningReplica], pending: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        by_id = {ReplicaId(r.replica_id.unique_id): r for r in candidates}
        request = _generate_request(pending)
        if request is None:
            return [candidates]  # other calls: Serve picks the least loaded
        key = PrefixKey(
            tuple(BlockHash(h) for h in request.block_hashes), self._config.cache.block_size
        )
        route = RouteRequest(
            request.request_id, key, len(request.prompt_token_ids), request.sampling.max_tokens
        )
        group = self._policy.prefix_group(route)
        view = await self._registry_view(key, list(by_id), group)
        snapshots = self._snapshots(candidates)
        decision = self._policy.route(route, snapshots, view, time.monotonic())
        self._apply(request, route, decision, view.hits, group)
        ranked = [[by_id[r] for r in tier if r in by_id] for tier in decision.ranked]
        return [tier for tier in ranked if tier] or [candidates]

    def _snapshots(self, candidates: Sequence[RunningReplica]) -> list[ReplicaSnapshot]:
        with self._local.lock:
            ledger = self._local.ledger.load()
        snapshots = []
        for replica in candidates:
            replica_id = ReplicaId(replica.replica_id.unique_id)
            stats = replica.routing_stats or {}
            own = ledger.get(replica_id) or LedgerLoad()
            if self._sole_router:
                # Every request to the replicas passes through this ingress: the ledger is
                # exact and current, while a report can be a second old (a stale report would
                # charge a replica for requests it has finished, and push its prefix away).
                queued, running = own.queued_requests, own.running_requests
                pending = own.pending_prefill_tokens
            else:  # other ingresses route too: their load is only in the (lagging) reports
                queued = max(int(stats.get("queued_requests", 0)), own.queued_requests)
                running = max(int(stats.get("running_requests", 0)), own.running_requests)
                pending = max(
                    int(stats.get("pending_prefill_tokens", 0)), own.pending_prefill_tokens
                )
            capacity = capacity_from_stats(stats, self._default_capacity)
            active_blocks = int(float(stats.get("kv_usage", 0.0)) * capacity.kv_blocks)
            snapshots.append(
                ReplicaSnapshot(replica_id, capacity, queued, running, pending, active_blocks)
            )
        return snapshots

    async def _registry_view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> RegistryView:
        if self._config.registry.backend == "memory":
            with self._local.lock:
                hits = self._local.registry.lookup(key, replicas)
                rate = self._local.registry.rate(group) if group is not None else 0.0
            return RegistryView(hits, rate)
        registry = await self._remote_registry()
        lookup = registry.lookup(key, replicas, deadline_s=self._deadline_s)
        if group is None:
            return RegistryView(await lookup, 0.0)
        hits, rate = await asyncio.gather(lookup, _bounded(registry.rate(group), self._deadline_s))
        return RegistryView(hits, rate)

    def _apply(
        self,
        request: GenerateRequest,
        route: RouteRequest,
        decision: RouteDecision,
        hits: dict[ReplicaId, PrefixHit],
        group: BlockHash | None,
    ) -> None:
        chosen = decision.chosen
        hit = hits.get(chosen)
        uncached = route.prompt_tokens - (hit.num_blocks * route.key.block_size if hit else 0)
        if decision.hold is not None:
            request.hold = HoldInstruction(decision.hold.num_blocks, decision.hold.max_wait_s)
        request.routed_by = decision.reason
        ttl_s = self._config.registry.speculative_ttl_s
        weight = self._policy.traffic_weight(route)
        with self._local.lock:
            first_time = self._local.ledger.routed(request.request_id, chosen, max(uncached, 0))
            counters = self._local.counters
            counters.decisions += 1
            counters.holds += decision.hold is not None
            counters.reasons[decision.reason] = counters.reasons.get(decision.reason, 0) + 1
            if first_time and self._config.registry.backend == "memory":
                self._local.registry.add_speculative(route.key, chosen, ttl_s)
                if group is not None:
                    self._local.registry.touch(group, weight)
        if not first_time:
            return
        self._policy.on_routed(route, chosen, time.monotonic())
        if self._remote is not None:
            self._spawn(self._remote.add_speculative(route.key, chosen, ttl_s))
            if group is not None:
                self._spawn(self._remote.touch(group, weight))

    # ---- helpers ---------------------------------------------------------------------------

    async def _remote_registry(self) -> CacheRegistry:
        if self._remote is None:
            self._remote = make_registry(self._config)
            await self._remote.connect()
        return self._remote

    def _spawn(self, coroutine: Any) -> None:
        """Run ``coroutine`` on the router's loop, from it or from another thread (Serve's
        membership callbacks are not always on it)."""
        loop = self._event_loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            asyncio.run_coroutine_threadsafe(coroutine, loop)
            return
        task = loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _power_of_two(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        if len(candidates) <= 2:
            return [list(candidates)]
        return [self._rng.sample(candidates, 2)]


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for value in (*pending.args, *pending.kwargs.values()):
        if isinstance(value, GenerateRequest):
            return value
    return None


async def _bounded(coroutine: Any, timeout_s: float) -> float:
    try:
        return float(await asyncio.wait_for(coroutine, timeout_s))
    except (TimeoutError, Exception):
        return 0.0
