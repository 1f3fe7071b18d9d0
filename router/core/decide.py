"""``RoutingCore``: one router's decisions, without Ray.

For a ``GenerateRequest`` and the candidate replicas (their ids and latest ``ReplicaReport``s)
it builds replica snapshots (the reports and this router's own ledger, ``replica_load.py``),
asks the registry what each candidate holds (within ``lookup_deadline_ms``), lets the policy
decide, returns the decision (``Routed``), and records speculative entries and the group's
traffic. A decision that sends a cold long prefix to be computed also claims it in the
registry, or is held on the replica that claimed it first (``holds.py``). Ray Serve's request
router (``serve_router.py``) wraps it; tests drive several of them against one Redis.

The registry is a ``CacheRegistry``, whatever its backend: the in-process one (over the state
``LocalRouterState`` shares with the ingress, under its lock) or a Redis client, created on
first use and connected in the background so that no decision waits for a connect. Its calls
are awaited only when not already done (``settled``): the in-process registry answers at
once, so a decision on it never yields to the loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prefixmesh.cache_registry.factory import make_registry
from prefixmesh.cache_registry.hashing import FingerprintMismatchError
from prefixmesh.cache_registry.protocol import CacheRegistry, settled
from prefixmesh.cache_registry.types import SHARED_TIER, BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.core import holds
from prefixmesh.router.core.holds import ClaimSettings, claim_prefix
from prefixmesh.router.core.ledger import LedgerLoad
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.router.core.replica_load import load_rule, pooled_capacities, snapshot_of
from prefixmesh.router.core.spans import note_hit, note_lookup
from prefixmesh.router.policy import make_policy
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    registry_view,
)
from prefixmesh.wire import GenerateRequest, Hold, ReplicaReport, RouteTicket

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], None]
CONNECT_WAIT_S = 0.05
"""Most a new router's first decisions wait for its registry client to be ready (once)."""


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing decision as the router uses it: the policy's ranking and hold (after claims),
    what the chosen replica holds of the prompt and the prefix claimed for it. Returned, never
    written into the request; what reaches the replica is its ``ticket``."""

    decision: RouteDecision
    matched_blocks: int
    """Leading prompt blocks the chosen replica holds (registry)."""
    claim: BlockHash | None = None
    """The prefix claimed for the chosen replica: it stays with the router (its ledger
    releases it at the first token or the end)."""

    @property
    def chosen(self) -> ReplicaId:
        return self.decision.chosen

    @property
    def hold(self) -> Hold | None:
        hold: Hold | None = self.decision.hold
        return hold

    def ticket(
        self, request: GenerateRequest, trace_context: Mapping[str, str] | None = None
    ) -> RouteTicket:
        """The decision as it travels to the replica (``trace_context``: the decision's span,
        else the request's)."""
        return RouteTicket(
            request_id=request.request_id,
            replica_id=self.chosen,
            reason=self.reason,
            matched_blocks=self.matched_blocks,
            hold=self.hold,
            trace_context=trace_context if trace_context is not None else request.trace_context,
        )

    @property
    def ranked(self) -> tuple[tuple[ReplicaId, ...], ...]:
        return self.decision.ranked

    @property
    def reason(self) -> str:
        return self.decision.reason


@dataclass(frozen=True, slots=True)
class Candidate:
    replica_id: ReplicaId
    report: ReplicaReport
    """The replica's latest report (an empty one before the first)."""


class RoutingCore:
    def __init__(
        self,
        config: PrefixmeshConfig,
        local: LocalRouterState,
        *,
        policy: RoutingPolicy | None = None,
        rng: random.Random | None = None,
        registry: CacheRegistry | None = None,
        spawn: Spawn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``policy``: made from the config (with ``rng``) when not given. ``registry``: a
        client to use as it is (tests); else one is made from the config on first use.
        ``spawn``: runs background work, from any thread (default: a task on the running
        loop). ``clock``: the policy's and the ledger's time, in seconds."""
        self.config = config
        self.local = local
        self._clock = clock
        self.policy: RoutingPolicy = policy or make_policy(
            config.routing.policy,
            config.routing,
            rng=rng or random.Random(),
            block_size=config.cache.block_size,
        )
        vllm = config.replica.vllm
        self._assumed_capacity = ReplicaCapacity(
            prefill_tokens_per_s=vllm.prefill_tokens_per_s,
            decode_step_s=vllm.decode_step_s,
            max_batch_tokens=vllm.max_num_batched_tokens,
            kv_blocks=1,
            tp_degree=vllm.tensor_parallel_size,
        )
        """A replica's capacity until it reports its own."""
        self._capacity_noise_rel = config.routing.capacity_noise_rel
        self._pooled: tuple[tuple[ReplicaCapacity, ...], list[ReplicaCapacity]] = ((), [])
        """The last candidates' capacities and their pooled form (reports change them only
        every stats period, so most decisions reuse it)."""
        self._deadline_s = config.registry.lookup_deadline_ms / 1000
        self._direct = config.serving.path == "direct"
        """Requests reach replicas past Serve's handle: no first-token or end callbacks; the
        replicas' reports list the requests they have seen (``LoadLedger.seen``)."""
        self._progress_pushed = config.progress_to_router
        self._load_rule = load_rule(
            self._direct, config.ingress.num_replicas == 1, self._progress_pushed
        )
        self._unseen_expiry_s = config.ingress.request_timeout_s
        self.metrics = local.metrics
        self.backend = config.registry.backend
        """The registry backend's name, a label of the lookup metrics and spans."""
        self.registry: CacheRegistry | None = registry
        """The registry client; None until first used."""
        self._spawn = spawn or self._spawn_here
        self._background: set[asyncio.Future[Any]] = set()
        self._claims = ClaimSettings.from_config(config)
        self._connecting: asyncio.Task[None] | None = None
        with local.lock:
            # Every claim this router takes is released here (``holds.py``).
            local.ledger.release_claim = self._release_claim

    # ---- the decision ----------------------------------------------------------------------

    async def decide(self, request: GenerateRequest, candidates: Sequence[Candidate]) -> Routed:
        """Route ``request`` among ``candidates`` (at least one)."""
        started = time.perf_counter()
        ids = [candidate.replica_id for candidate in candidates]
        key = request.key
        route = RouteRequest(
            request.request_id, key, len(request.prompt_token_ids), request.sampling.max_tokens
        )
        group = self.policy.prefix_group(route)
        view, outcome = await self._view(key, ids, group)
        snapshots = self.snapshots(candidates)
        decision = self.policy.route(route, snapshots, view, self._clock())
        claim, wait_s = None, 0.0
        with self.local.lock:
            first_time = self.local.ledger.replica_of(request.request_id) is None
        # A registry that missed its deadline would miss this one too: no claim then.
        if first_time and outcome in ("ok", "empty"):
            prefix = claim_prefix(self._claims, route, decision, view.hits)
            if prefix is not None:
                claimed = await holds.claim(
                    self.start_registry(),
                    self._claims,
                    prefix,
                    route,
                    decision,
                    snapshots,
                    self._keep,
                )
                decision, claim, wait_s = claimed.decision, claimed.claim, claimed.wait_s
        hit = await self._apply(request, route, decision, view.hits, group, claim, wait_s)
        note_hit(hit)
        routed = Routed(decision, hit.num_blocks if hit else 0, claim)
        self.metrics.decided(
            self.policy.name,
            decision.reason,
            hit.num_blocks if hit else 0,
            hit.deepest_tier.name.lower() if hit and hit.num_blocks else "none",
            decision.hold is not None,
            time.perf_counter() - started,
        )
        return routed

    def snapshots(self, candidates: Sequence[Candidate]) -> list[ReplicaSnapshot]:
        with self.local.lock:
            if self._direct:
                reports = [(c.replica_id, c.report) for c in candidates]
                self.local.apply_reports(
                    reports,
                    self._clock(),
                    self._unseen_expiry_s,
                    progress_pushed=self._progress_pushed,
                )
            ledger = self.local.ledger.load()
        snapshots = []
        for candidate in candidates:
            replica_id = candidate.replica_id
            own = ledger.get(replica_id) or LedgerLoad()
            snapshot = snapshot_of(
                replica_id, candidate.report, self._assumed_capacity, own, self._load_rule
            )
            self.metrics.saw_load(
                replica_id,
                snapshot.queued_requests,
                snapshot.running_requests,
                snapshot.pending_prefill_tokens,
            )
            snapshots.append(snapshot)
        return self._pool(snapshots)

    def _pool(self, snapshots: list[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
        """The snapshots with their capacities pooled (``pooled_capacities``)."""
        capacities = tuple(s.capacity for s in snapshots)
        known, pooled = self._pooled
        if capacities != known:
            pooled = pooled_capacities(capacities, self._capacity_noise_rel)
            self._pooled = (capacities, pooled)
        return [
            s if s.capacity is capacity else replace(s, capacity=capacity)
            for s, capacity in zip(snapshots, pooled, strict=True)
        ]

    async def registry_view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> RegistryView:
        return (await self._view(key, replicas, group))[0]

    async def _view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> tuple[RegistryView, str]:
        """What the registry says, and the lookup's outcome (see ``_lookup_outcome``)."""
        started = time.perf_counter()
        registry = self.start_registry()
        await self._connected()
        failures = registry.stats.lookup_failures
        available = registry.available
        # The group's rate runs alongside the lookup (which keeps its own deadline).
        rate_call = asyncio.ensure_future(registry.rate(group)) if group is not None else None
        # The cluster's shared tier is one more holder (credited to every replica).
        holders = [*replicas, SHARED_TIER]
        hits = await registry.lookup(key, holders, deadline_s=self._deadline_s)
        rate = 0.0
        if rate_call is not None:
            left_s = self._deadline_s - (time.perf_counter() - started)
            done = await settled(rate_call, left_s)
            if done and not rate_call.cancelled() and rate_call.exception() is None:
                rate = float(rate_call.result())
            else:
                rate_call.cancel()
        elapsed_s = time.perf_counter() - started
        outcome = _lookup_outcome(
            hits, elapsed_s, self._deadline_s, available, registry.stats.lookup_failures > failures
        )
        self.metrics.looked_up(self.backend, outcome, elapsed_s)
        note_lookup(self.backend, outcome, elapsed_s)
        if outcome in ("timeout", "unavailable"):
            self.metrics.fell_back(f"registry_{outcome}")
        return registry_view(hits, rate), outcome

    async def _apply(
        self,
        request: GenerateRequest,
        route: RouteRequest,
        decision: RouteDecision,
        hits: Mapping[ReplicaId, PrefixHit],
        group: BlockHash | None,
        claim: BlockHash | None,
        wait_s: float,
    ) -> PrefixHit | None:
        """Record the decision in the shared state; the chosen one's hit. A claimed prefix's
        speculative entry is awaited up to ``wait_s``."""
        chosen = decision.chosen
        hit = hits.get(chosen)
        # Blocks the replica will not compute: those it holds, or those a hold waits for.
        covered = max(
            hit.num_blocks if hit else 0, decision.hold.num_blocks if decision.hold else 0
        )
        uncached = route.prompt_tokens - covered * route.key.block_size
        with self.local.lock:
            first_time = self.local.ledger.routed(
                request.request_id, chosen, max(uncached, 0), claim, self._clock()
            )
            counted = len(self.local.ledger)
        # Here, not when the router's own text is read: Ray's agent (the cluster view) takes
        # the value every few seconds, and on the direct path nobody reads that text.
        self.metrics.ongoing.set(counted)
        if not first_time:
            return hit
        self.policy.on_routed(route, chosen, self._clock())
        registry = self.start_registry()
        ttl_s = decision.speculative_ttl_s(self.config.registry.speculative_ttl_s)
        speculative = asyncio.ensure_future(registry.add_speculative(route.key, chosen, ttl_s))
        # A claimed prefix: siblings that come after the claim is released must find it here,
        # so the entry is written before the request leaves (bounded; a late write still
        # lands). Otherwise it lands in the background.
        if claim is None or not await settled(speculative, wait_s):
            self._keep(speculative)
        if group is not None:
            touch = registry.touch(group, self.policy.traffic_weight(route))
            self._keep(asyncio.ensure_future(touch))
        return hit

    # ---- membership and claims -------------------------------------------------------------

    def forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left from the policy, the ledger and the registry (from any
        thread: Serve's membership callbacks are not always on the router's loop)."""
        try:
            self.policy.on_replica_removed(replica)
            self.metrics.forget_replica(replica)
            with self.local.lock:
                self.local.ledger.forget_replica(replica)
                self.local.forget(replica)
            self._spawn(self._drop(replica))
        except Exception:
            logger.exception("forgetting replica %s failed", replica)

    async def _drop(self, replica: ReplicaId) -> None:
        await self.start_registry().drop_replica(replica)

    def _release_claim(self, prefix: BlockHash, replica: ReplicaId) -> None:
        """The ledger's hook, called under the local lock on whatever thread ended the entry:
        the release runs on the router's loop."""
        try:
            self._spawn(self._release(prefix, replica))
        except Exception:
            logger.exception("releasing the claim on %s failed; its TTL ends it", prefix)

    async def _release(self, prefix: BlockHash, replica: ReplicaId) -> None:
        await holds.release(self.start_registry(), prefix, replica)

    async def settle(self) -> None:
        """Wait for this core's background registry work (tests; a clean shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ---- the registry ----------------------------------------------------------------------

    def start_registry(self) -> CacheRegistry:
        """The registry client, created on first use with its ``connect`` started in the
        background: only the router's first decisions wait for it, once, at most
        ``CONNECT_WAIT_S`` (connect takes up to 4 op timeouts when Redis is down); lookups
        before it has checked the fingerprint return nothing known."""
        if self.registry is None:
            self.registry = make_registry(self.config, self.local.registry, self.local.lock)
            connect = self._connect(self.registry)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._spawn(connect)  # off the loop: not awaited by decisions
            else:
                self._connecting = loop.create_task(connect)
                self._keep(self._connecting)
        return self.registry

    async def _connected(self) -> None:
        """A new router's first decisions wait for its registry's fingerprint check, once, at
        most ``CONNECT_WAIT_S``: a few round trips on a fresh connection, and without it a new
        ingress routes its first requests blind to what Redis holds (Serve builds the router
        at the first request). A registry that is down costs that wait once, never again."""
        connecting = self._connecting
        if connecting is not None:
            if not connecting.done():
                await asyncio.wait({connecting}, timeout=CONNECT_WAIT_S)
            self._connecting = None

    @staticmethod
    async def _connect(registry: CacheRegistry) -> None:
        try:
            await registry.connect()
        except FingerprintMismatchError:
            logger.exception("the registry belongs to another cluster; routing without it")
        except Exception:
            logger.exception("registry connect failed; its calls retry on their own")

    def _spawn_here(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._keep(asyncio.get_running_loop().create_task(coroutine))

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a reference to background work until it is done (the loop keeps only weak
        ones); work already done needs none."""
        if task.done():
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _lookup_outcome(
    hits: Mapping[ReplicaId, PrefixHit],
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
