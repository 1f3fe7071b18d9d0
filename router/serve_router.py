"""``PrefixmeshRequestRouter``: the Ray Serve ``RequestRouter`` that runs our routing policies.

Serve calls ``choose_replicas`` in the ingress process (on the router's own event loop) for
every call on the replica handle. For a ``GenerateRequest`` it builds replica snapshots (the
replicas' reported stats, raised by this router's own ledger), asks the registry what each
candidate holds (within ``lookup_deadline_ms``), lets the policy decide, sets the request's hold,
and records speculative entries and the group's traffic. Any error falls back to power of two:
an exception inside a request router would hang the request (DESIGN.md §7), so nothing escapes.
A retried request names the replicas that failed it (``avoid_replicas``); they are left out
while any other candidate remains. Every decision lands in ``RouterMetrics``.
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
from prefixmesh.cache_registry.hashing import FingerprintMismatchError
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
        self._metrics = self._local.metrics
        self._backend = config.registry.backend
        self._remote: CacheRegistry | None = None  # the Redis client, made on the router loop
        self._background: set[asyncio.Task[Any]] = set()
        self._rng = random.Random()
        if self._backend != "memory":
            try:
                asyncio.get_running_loop()  # Serve builds routers on their loop: connect now
            except RuntimeError:
                pass  # off the loop: the first decision starts it (still without waiting)
            else:
                self._start_remote()

    # ---- Serve hooks -----------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generate_request(pending_request)
        if request is not None and request.avoid_replicas:
            # A retry: the replicas that failed it are left out, unless no other one is left.
            avoid = set(request.avoid_replicas)
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
            candidate_replicas = kept or candidate_replicas
        try:
            return await self._choose(candidate_replicas, request)
        except Exception:
            logger.exception("routing failed; falling back to power of two")
            self._metrics.fell_back("error")
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
            self._metrics.forget_replica(replica)
            with self._local.lock:
                self._local.ledger.forget_replica(replica)
                if self._config.registry.backend == "memory":
                    self._local.registry.drop_replica(replica)
            if self._config.registry.backend != "memory":
                self._spawn(self._drop_remote(replica))
        except Exception:
            logger.exception("forgetting replica %s failed", replica)

    async def _drop_remote(self, replica: ReplicaId) -> None:
        await self._start_remote().drop_replica(replica)

    # ---- the decision ----------------------------------------------------------------------

    async def _choose(
        self, candidates: list[RunningReplica], request: GenerateRequest | None
    ) -> list[list[RunningReplica]]:
        if request is None:
            return [candidates]  # other calls: Serve picks the least loaded
        started = time.perf_counter()
        by_id = {ReplicaId(r.replica_id.unique_id): r for r in candidates}
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
        hit = self._apply(request, route, decision, view.hits, group)
        self._metrics.decided(
            self._policy.name,
            decision.reason,
            hit.num_blocks if hit else 0,
            hit.deepest_tier.name.lower() if hit and hit.num_blocks else "none",
            decision.hold is not None,
            time.perf_counter() - started,
        )
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
            self._metrics.saw_load(replica_id, queued, running, pending)
            snapshots.append(
                ReplicaSnapshot(replica_id, capacity, queued, running, pending, active_blocks)
            )
        return snapshots

    async def _registry_view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> RegistryView:
        started = time.perf_counter()
        if self._backend == "memory":
            with self._local.lock:
                hits = self._local.registry.lookup(key, replicas)
                rate = self._local.registry.rate(group) if group is not None else 0.0
            outcome = "ok" if hits else "empty"
            self._metrics.looked_up(self._backend, outcome, time.perf_counter() - started)
            return RegistryView(hits, rate)
        registry = self._start_remote()
        failures = registry.stats.lookup_failures
        available = bool(getattr(registry, "available", True))
        lookup = registry.lookup(key, replicas, deadline_s=self._deadline_s)
        if group is None:
            hits, rate = await lookup, 0.0
        else:
            rate_call = _bounded(registry.rate(group), self._deadline_s)
            hits, rate = await asyncio.gather(lookup, rate_call)
        elapsed_s = time.perf_counter() - started
        outcome = _lookup_outcome(
            hits, elapsed_s, self._deadline_s, available, registry.stats.lookup_failures > failures
        )
        self._metrics.looked_up(self._backend, outcome, elapsed_s)
        if outcome in ("timeout", "unavailable"):
            self._metrics.fell_back(f"registry_{outcome}")
        return RegistryView(hits, rate)

    def _apply(
        self,
        request: GenerateRequest,
        route: RouteRequest,
        decision: RouteDecision,
        hits: dict[ReplicaId, PrefixHit],
        group: BlockHash | None,
    ) -> PrefixHit | None:
        """Write the decision into the request and the shared state; the chosen one's hit."""
        chosen = decision.chosen
        hit = hits.get(chosen)
        uncached = route.prompt_tokens - (hit.num_blocks * route.key.block_size if hit else 0)
        # A decision made again for the same request (Serve retries routing) replaces the hold.
        request.hold = (
            HoldInstruction(decision.hold.num_blocks, decision.hold.max_wait_s)
            if decision.hold is not None
            else None
        )
        request.routed_by = decision.reason
        request.routed_to = chosen
        request.matched_blocks = hit.num_blocks if hit else 0
        ttl_s = self._config.registry.speculative_ttl_s
        weight = self._policy.traffic_weight(route)
        with self._local.lock:
            first_time = self._local.ledger.routed(request.request_id, chosen, max(uncached, 0))
            if first_time and self._backend == "memory":
                self._local.registry.add_speculative(route.key, chosen, ttl_s)
                if group is not None:
                    self._local.registry.touch(group, weight)
        if not first_time:
            return hit
        self._policy.on_routed(route, chosen, time.monotonic())
        if self._remote is not None:
            self._spawn(self._remote.add_speculative(route.key, chosen, ttl_s))
            if group is not None:
                self._spawn(self._remote.touch(group, weight))
        return hit

    # ---- helpers ---------------------------------------------------------------------------

    def _start_remote(self) -> CacheRegistry:
        """The Redis client, created on first use with its ``connect`` started in the
        background: a decision never waits for it (connect takes up to 4 op timeouts when
        Redis is down); lookups before it has checked the fingerprint return nothing known."""
        if self._remote is None:
            self._remote = make_registry(self._config)
            self._spawn(self._connect(self._remote))
        return self._remote

    @staticmethod
    async def _connect(registry: CacheRegistry) -> None:
        try:
            await registry.connect()
        except FingerprintMismatchError:
            logger.exception("the registry belongs to another cluster; routing without it")
        except Exception:
            logger.exception("registry connect failed; its calls retry on their own")

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


def _lookup_outcome(
    hits: dict[ReplicaId, PrefixHit],
    elapsed_s: float,
    deadline_s: float,
    available: bool,
    failed: bool,
) -> str:
    """``ok``, ``empty`` (the registry answered: nobody holds it), ``timeout`` (no answer by
    the deadline) or ``unavailable`` (down, backing off, or not yet verified)."""
    if hits:
        return "ok"
    if not available:
        return "unavailable"
    if failed:
        return "timeout" if elapsed_s >= deadline_s * 0.9 else "unavailable"
    return "empty"


async def _bounded(coroutine: Any, timeout_s: float) -> float:
    try:
        return float(await asyncio.wait_for(coroutine, timeout_s))
    except (TimeoutError, Exception):
        return 0.0
