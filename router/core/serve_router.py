"""``PrefixmeshRequestRouter``: the Ray Serve ``RequestRouter`` that runs our routing policies.

Serve calls ``choose_replicas`` in the ingress process (on the router's own event loop) for
every call on the replica handle. For a ``GenerateRequest`` it hands the candidates' ids and
latest reports (Serve's dicts, converted once each: ``LocalRouterState.report``) to
``RoutingCore`` (``decide.py``: registry lookup, policy, hold, claim, speculative entries) and
maps the ranking back to Serve's replicas. Any error falls back to power of two: an exception
inside a request router would hang the request (docs/design.md §7), so nothing escapes. A retried
request names the replicas that failed it (``avoid_replicas``); they are left out while any
other candidate remains. Every decision lands in ``RouterMetrics``.

The decision leaves as one ``RouteTicket``, on two channels and never written into the
caller's request: the replica gets a copy of the request carrying it (``send_instead``: Serve
sends the pending request's arguments after routing), and the ingress or the direct path's
router takes it from the state they share (``LocalRouterState.take_ticket``). A claim stays
with the router: its ledger releases it at the first token or the end. Serve's private API is
reached only through ``prefixmesh/serve_private.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

from prefixmesh.cache_registry.factory import make_memory_state
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.core.decide import Candidate, RoutingCore
from prefixmesh.router.core.local_state import LocalRouterState, local_state
from prefixmesh.router.core.spans import route_span
from prefixmesh.serve_private import ServeRequestRouter, pending_arguments, send_instead
from prefixmesh.wire import GenerateRequest, LoadBalanced

logger = logging.getLogger(__name__)


class PrefixmeshRequestRouter(ServeRequestRouter):
    def initialize_state(
        self,
        config_json: str = "{}",
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        **_: Any,
    ) -> None:
        """Serve calls it with ``config_json``; tests may pass ``rng`` and ``clock`` (the
        decisions' time, and when tickets nobody took expire)."""
        self._config = PrefixmeshConfig.model_validate_json(config_json)
        config = self._config
        self._local: LocalRouterState = local_state(
            config.app_name, lambda: make_memory_state(config)
        )
        with self._local.lock:
            self._local.stats_source = self
        self._core = RoutingCore(config, self._local, spawn=self._spawn, clock=clock)
        self._metrics = self._local.metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._rng = rng or random.Random()
        self._clock = clock
        self._ticket_keep_s = config.ingress.request_timeout_s
        """How long a ticket nobody took stays in the shared state (a caller that gave up)."""
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
            isinstance(a, LoadBalanced) for a in pending_arguments(pending_request)
        ):
            return self._less_loaded_of_two(candidate_replicas)
        request = _generate_request(pending_request)
        if request is not None and request.avoid_replicas:
            # A retry: the replicas that failed it are left out, unless no other one is left.
            avoid = set(request.avoid_replicas)
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
            candidate_replicas = kept or candidate_replicas
        try:
            return await self._choose(candidate_replicas, request, pending_request)
        except Exception:
            logger.exception("routing failed; falling back to power of two")
            self._metrics.fell_back("error")
            return self._power_of_two(candidate_replicas)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(ReplicaId(replica_id.unique_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Serve calls this whenever its replica set changes: scale-down, a redeploy, a replica
        # replaced after failing health checks. A replica that left takes its registry entries
        # with it, or routers would keep sending its prefixes to replicas that never see them.
        known = self.known_replica_ids()
        current = {replica.replica_id for replica in replicas}
        super().update_replicas(replicas)
        for gone in known - current:
            self._forget(ReplicaId(gone.unique_id))

    def _forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left from the policy, the ledger and the registry."""
        self._core.forget(replica)

    # ---- the decision ----------------------------------------------------------------------

    async def _choose(
        self,
        candidates: list[RunningReplica],
        request: GenerateRequest | None,
        pending: PendingRequest | None = None,
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
            span.decided(self._core.policy.name, routed.decision, routed.matched_blocks)
        ticket = routed.ticket(request, span.carrier)
        with local.lock:
            # A decision made again for the same request (Serve re-routes it) replaces it.
            local.record_ticket(ticket, self._clock(), self._ticket_keep_s)
        if pending is not None:
            # The replica gets the decision on its own copy of the request; its spans are the
            # decision's children.
            sent = dataclasses.replace(request, ticket=ticket, trace_context=ticket.trace_context)
            send_instead(pending, request, sent)
        ranked = [[by_id[r] for r in tier if r in by_id] for tier in routed.ranked]
        return [tier for tier in ranked if tier] or [candidates]

    # ---- helpers ---------------------------------------------------------------------------

    def _spawn(self, coroutine: Any) -> None:
        """Run ``coroutine`` on the router's loop, from it or from another thread (Serve's
        membership callbacks are not always on it)."""
        loop = self.router_loop()
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


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for value in pending_arguments(pending):
        if isinstance(value, GenerateRequest):
            return value
    return None
