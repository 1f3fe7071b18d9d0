"""``PrefixmeshRequestRouter``: the Ray Serve ``RequestRouter`` that runs our routing policies.

Serve calls ``choose_replicas`` in the ingress process (on the router's own event loop) for
every call on the replica handle. For a ``GenerateRequest`` it hands the candidates' ids and
latest reports (Serve's dicts, converted once each: ``LocalRouterState.report``) to
``RoutingCore`` (``decide.py``: registry lookup, policy, hold, claim, speculative entries) and
maps the ranking back to Serve's replicas. Any error falls back to power of two: an exception
inside a request router would hang the request (DESIGN.md §7), so nothing escapes. A retried
request names the replicas that failed it (``avoid_replicas``); they are left out while any
other candidate remains. Every decision lands in ``RouterMetrics``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from prefixmesh.cache_registry.factory import make_memory_state
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.decide import Candidate, Routed, RoutingCore
from prefixmesh.router.local_state import LocalRouterState, local_state
from prefixmesh.router.spans import route_span
from prefixmesh.wire import GenerateRequest, LoadBalanced

logger = logging.getLogger(__name__)


class PrefixmeshRequestRouter(RequestRouter):
    def initialize_state(self, config_json: str = "{}", **_: Any) -> None:
        self._config = PrefixmeshConfig.model_validate_json(config_json)
        config = self._config
        self._local: LocalRouterState = local_state(
            config.app_name, lambda: make_memory_state(config)
        )
        with self._local.lock:
            self._local.stats_source = self
        self._core = RoutingCore(config, self._local, spawn=self._spawn)
        self._metrics = self._local.metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._rng = random.Random()
        try:
            asyncio.get_running_loop()  # Serve builds routers on their loop: connect now
        except RuntimeError:
            pass  # off the loop: the first decision starts it (still without waiting)
        else:
            self._core.start_registry()

    # ---- Serve hooks -----------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None and any(
            isinstance(a, LoadBalanced) for a in pending_request.args
        ):
            return self._less_loaded_of_two(candidate_replicas)
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
        known: set[Any] = getattr(self, "_replica_id_set", set())
        current = {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        for gone in known - current:
            self._forget(ReplicaId(gone.unique_id))

    def _forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left from the policy, the ledger and the registry."""
        self._core.forget(replica)

    # ---- the decision ----------------------------------------------------------------------

    async def _choose(
        self, candidates: list[RunningReplica], request: GenerateRequest | None
    ) -> list[list[RunningReplica]]:
        if request is None:
            return [candidates]  # other calls: Serve picks the least loaded
        by_id = {ReplicaId(r.replica_id.unique_id): r for r in candidates}
        local = self._local
        with local.lock:
            reports = [
                Candidate(rid, local.report(rid, r.routing_stats)) for rid, r in by_id.items()
            ]
        with route_span(request) as span:  # a no-op when tracing is off
            routed = await self._core.decide(request, reports)
            _carry(request, routed)
            span.decided(self._core.policy.name, routed.decision, request)
        ranked = [[by_id[r] for r in tier if r in by_id] for tier in routed.ranked]
        return [tier for tier in ranked if tier] or [candidates]

    # ---- helpers ---------------------------------------------------------------------------

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

    def _less_loaded_of_two(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Power of two on the replicas' reports, the less loaded first (the direct path's
        router takes the first replica of the first rank)."""
        pair = self._rng.sample(candidates, min(2, len(candidates)))
        local = self._local
        with local.lock:
            load = {
                id(r): local.report(r.replica_id.unique_id, r.routing_stats).ongoing_requests
                for r in pair
            }
        return [sorted(pair, key=lambda r: load[id(r)])]

    def _power_of_two(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        if len(candidates) <= 2:
            return [list(candidates)]
        return [self._rng.sample(candidates, 2)]


def _carry(request: GenerateRequest, routed: Routed) -> None:
    """The proxy path's one hand-off: the decision rides on the handle call's argument, the
    only thing that reaches the replica (a decision made again for the same request, when
    Serve retries routing, replaces it). A claim stays with the router: its ledger releases
    it at the first token or the end."""
    request.hold = routed.hold
    request.routed_by = routed.reason
    request.routed_to = routed.chosen
    request.matched_blocks = routed.matched_blocks


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for value in (*pending.args, *pending.kwargs.values()):
        if isinstance(value, GenerateRequest):
            return value
    return None
