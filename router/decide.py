"""``RoutingCore``: one router's decisions, without Ray.

For a ``GenerateRequest`` and the candidate replicas (their ids and latest reported stats) it
builds replica snapshots (the reports, raised by this router's own ledger), asks the registry
what each candidate holds (within ``lookup_deadline_ms``), lets the policy decide, returns the
decision (``Routed``), and records speculative entries and the group's traffic. A decision
that sends a cold long prefix to be computed also claims it in the registry, or is held on the
replica that claimed it first (``claims.py``). Ray Serve's request router (``serve_router.py``)
wraps it; tests drive several of them against one Redis.

Registry access: the in-process ``RegistryState`` of ``LocalRouterState`` (memory backend,
under its lock), or a shared ``CacheRegistry`` client (Redis), created on first use and
connected in the background so that no decision waits for a connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.cache_registry.factory import make_registry
from prefixmesh.cache_registry.hashing import FingerprintMismatchError
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.types import BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.claims import (
    ClaimSettings,
    bound_s,
    claim_prefix,
    claim_wait_s,
    held_on,
)
from prefixmesh.router.ledger import LedgerLoad
from prefixmesh.router.local_state import LocalRouterState
from prefixmesh.router.policy import make_policy
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from prefixmesh.router.spans import note_hit, note_lookup
from prefixmesh.wire import GenerateRequest, HoldInstruction

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], None]
CONNECT_WAIT_S = 0.05
"""Most a new router's first decisions wait for its registry client to be ready (once)."""


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing decision as whoever asked for it uses it: the replica, what it holds of the
    prompt, the hold it waits under and the prefix claimed for it. Returned, never written
    into the request (the proxy path's Serve adapter copies it onto the handle call)."""

    decision: RouteDecision
    matched_blocks: int
    """Leading prompt blocks the chosen replica holds (registry)."""
    hold: HoldInstruction | None = None
    claim: BlockHash | None = None

    @property
    def chosen(self) -> ReplicaId:
        return self.decision.chosen

    @property
    def ranked(self) -> tuple[tuple[ReplicaId, ...], ...]:
        return self.decision.ranked

    @property
    def reason(self) -> str:
        return self.decision.reason


@dataclass(frozen=True, slots=True)
class Candidate:
    replica_id: ReplicaId
    stats: Mapping[str, Any]
    """The replica's latest ``record_routing_stats`` report ({} before the first)."""


def capacity_from_stats(stats: Mapping[str, Any], default: ReplicaCapacity) -> ReplicaCapacity:
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
    ) -> None:
        """``policy``: made from the config (with ``rng``) when not given. ``registry``: a
        shared client to use as it is (tests); else one is made from the config on first use.
        ``spawn``: runs background work (default: a task on the running loop)."""
        self.config = config
        self.local = local
        self.policy: RoutingPolicy = policy or make_policy(
            config.routing.policy,
            config.routing,
            rng=rng or random.Random(),
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
        self._direct = config.serving.path == "direct"
        """Requests reach replicas past Serve's handle: no first-token or end callbacks; the
        replicas' reports list the requests they have seen (``LoadLedger.seen``)."""
        self._unseen_expiry_s = config.ingress.request_timeout_s
        self.metrics = local.metrics
        self.backend = config.registry.backend
        self.remote: CacheRegistry | None = registry
        """The shared registry client (Redis backend); None until first used."""
        self._spawn = spawn or self._spawn_here
        self._background: set[asyncio.Future[Any]] = set()
        self._claims = ClaimSettings.from_config(config)
        self._connecting: asyncio.Task[None] | None = None
        if self.backend == "memory":
            # Nothing else reaches the in-process registry: the ingress's first-token call on
            # the ledger releases a request's claim.
            with local.lock:
                local.ledger.release_claim = local.registry.release_inflight

    # ---- the decision ----------------------------------------------------------------------

    async def decide(self, request: GenerateRequest, candidates: Sequence[Candidate]) -> Routed:
        """Route ``request`` among ``candidates`` (at least one)."""
        started = time.perf_counter()
        ids = [candidate.replica_id for candidate in candidates]
        key = PrefixKey(
            tuple(BlockHash(h) for h in request.block_hashes), self.config.cache.block_size
        )
        route = RouteRequest(
            request.request_id, key, len(request.prompt_token_ids), request.sampling.max_tokens
        )
        group = self.policy.prefix_group(route)
        view, outcome = await self._view(key, ids, group)
        snapshots = self.snapshots(candidates)
        decision = self.policy.route(route, snapshots, view, time.monotonic())
        claim, wait_s = None, 0.0
        with self.local.lock:
            first_time = self.local.ledger.replica_of(request.request_id) is None
        # A registry that missed its deadline would miss this one too: no claim then.
        if first_time and outcome in ("ok", "empty"):
            prefix = claim_prefix(self._claims, route, decision, view.hits)
            if prefix is not None:
                decision, claim, wait_s = await self._claim(prefix, route, decision, snapshots)
        hit = await self._apply(request, route, decision, view.hits, group, claim, wait_s)
        note_hit(hit)
        hold = decision.hold
        routed = Routed(
            decision,
            hit.num_blocks if hit else 0,
            HoldInstruction(hold.num_blocks, hold.max_wait_s) if hold is not None else None,
            claim,
        )
        self.metrics.decided(
            self.policy.name,
            decision.reason,
            hit.num_blocks if hit else 0,
            hit.deepest_tier.name.lower() if hit and hit.num_blocks else "none",
            decision.hold is not None,
            time.perf_counter() - started,
        )
        return routed

    async def _claim(
        self,
        prefix: BlockHash,
        route: RouteRequest,
        decision: RouteDecision,
        snapshots: Sequence[ReplicaSnapshot],
    ) -> tuple[RouteDecision, BlockHash | None, float]:
        """Claim ``prefix`` for the chosen replica: the decision and the claim it carries, or
        the decision turned into a hold on the replica that claimed the prefix first; and how
        long the decision may wait on the registry for it."""
        chosen = decision.chosen
        by_id = {snapshot.replica_id: snapshot for snapshot in snapshots}
        ttl_s = bound_s(self._claims, by_id[chosen], route.prompt_tokens)
        wait_s = claim_wait_s(self._claims, by_id[chosen], route.prompt_tokens)
        holder = await self._claim_inflight(prefix, chosen, ttl_s, wait_s)
        if holder == chosen:
            return decision, prefix, wait_s
        snapshot = by_id.get(holder) if holder is not None else None
        if holder is None or snapshot is None:
            return decision, None, wait_s  # no answer, or a holder we may not use (avoided)
        hold = Hold(self._claims.claim_blocks, bound_s(self._claims, snapshot, route.prompt_tokens))
        return held_on(decision, holder, hold), None, wait_s

    async def _claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float, wait_s: float
    ) -> ReplicaId | None:
        """The claim's holder after the attempt; None if the registry could not answer."""
        if self.backend == "memory":
            with self.local.lock:
                return self.local.registry.claim_inflight(prefix, replica, ttl_s)
        registry = self.start_remote()
        # Shielded: a late answer is not cancelled mid-command, it lands in the background.
        claim = asyncio.ensure_future(registry.claim_inflight(prefix, replica, ttl_s))
        try:
            return await asyncio.wait_for(asyncio.shield(claim), wait_s)
        except TimeoutError:
            # The claim may land: carry it (releasing a claim we do not hold is a no-op), and
            # compute as if no one else were.
            self._keep(claim)
            return replica

    def snapshots(self, candidates: Sequence[Candidate]) -> list[ReplicaSnapshot]:
        with self.local.lock:
            if self._direct:
                reports = [(c.replica_id, c.stats) for c in candidates]
                self.local.apply_reports(reports, time.monotonic(), self._unseen_expiry_s)
            ledger = self.local.ledger.load()
        snapshots = []
        for candidate in candidates:
            replica_id = candidate.replica_id
            stats = candidate.stats
            own = ledger.get(replica_id) or LedgerLoad()
            if self._direct:
                # The report counts what reached the replica; the ledger holds only what this
                # router sent that no report has listed yet (on its way, or just arrived).
                queued = int(stats.get("queued_requests", 0)) + own.queued_requests
                running = int(stats.get("running_requests", 0)) + own.running_requests
                pending = int(stats.get("pending_prefill_tokens", 0)) + own.pending_prefill_tokens
            elif self._sole_router:
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
            self.metrics.saw_load(replica_id, queued, running, pending)
            snapshots.append(
                ReplicaSnapshot(replica_id, capacity, queued, running, pending, active_blocks)
            )
        return snapshots

    async def registry_view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> RegistryView:
        return (await self._view(key, replicas, group))[0]

    async def _view(
        self, key: PrefixKey, replicas: list[ReplicaId], group: BlockHash | None
    ) -> tuple[RegistryView, str]:
        """What the registry says, and the lookup's outcome (see ``_lookup_outcome``)."""
        started = time.perf_counter()
        if self.backend == "memory":
            with self.local.lock:
                hits = self.local.registry.lookup(key, replicas)
                rate = self.local.registry.rate(group) if group is not None else 0.0
            outcome = "ok" if hits else "empty"
            elapsed_s = time.perf_counter() - started
            self.metrics.looked_up(self.backend, outcome, elapsed_s)
            note_lookup(self.backend, outcome, elapsed_s)
            return RegistryView(hits, rate), outcome
        registry = self.start_remote()
        await self._connected()
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
        self.metrics.looked_up(self.backend, outcome, elapsed_s)
        note_lookup(self.backend, outcome, elapsed_s)
        if outcome in ("timeout", "unavailable"):
            self.metrics.fell_back(f"registry_{outcome}")
        return RegistryView(hits, rate), outcome

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
        ttl_s = self.config.registry.speculative_ttl_s
        weight = self.policy.traffic_weight(route)
        with self.local.lock:
            first_time = self.local.ledger.routed(
                request.request_id, chosen, max(uncached, 0), claim, time.monotonic()
            )
            if first_time and self.backend == "memory":
                self.local.registry.add_speculative(route.key, chosen, ttl_s)
                if group is not None:
                    self.local.registry.touch(group, weight)
        if not first_time:
            return hit
        self.policy.on_routed(route, chosen, time.monotonic())
        if self.remote is not None:
            speculative = self.remote.add_speculative(route.key, chosen, ttl_s)
            if claim is not None:
                # A claimed prefix: siblings that come after the claim is released must find
                # it here, so the entry is written before the request leaves (bounded; a late
                # write still lands).
                write = asyncio.ensure_future(speculative)
                self._keep(write)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(write), wait_s)
            else:
                self._spawn(speculative)
            if group is not None:
                self._spawn(self.remote.touch(group, weight))
        return hit

    # ---- membership ------------------------------------------------------------------------

    def forget(self, replica: ReplicaId) -> None:
        """Drop a replica that left from the policy, the ledger and the registry."""
        try:
            self.policy.on_replica_removed(replica)
            self.metrics.forget_replica(replica)
            with self.local.lock:
                self.local.ledger.forget_replica(replica)
                if self.backend == "memory":
                    self.local.registry.drop_replica(replica)
            if self.backend != "memory":
                self._spawn(self._drop_remote(replica))
        except Exception:
            logger.exception("forgetting replica %s failed", replica)

    async def _drop_remote(self, replica: ReplicaId) -> None:
        await self.start_remote().drop_replica(replica)

    # ---- the shared registry ---------------------------------------------------------------

    def start_remote(self) -> CacheRegistry:
        """The Redis client, created on first use with its ``connect`` started in the
        background: only the router's first decisions wait for it, once, at most
        ``CONNECT_WAIT_S`` (connect takes up to 4 op timeouts when Redis is down); lookups
        before it has checked the fingerprint return nothing known."""
        if self.remote is None:
            self.remote = make_registry(self.config)
            connect = self._connect(self.remote)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._spawn(connect)  # off the loop: not awaited by decisions
            else:
                self._connecting = loop.create_task(connect)
                self._keep(self._connecting)
        return self.remote

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
        ones)."""
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


async def _bounded(coroutine: Any, timeout_s: float) -> float:
    try:
        return float(await asyncio.wait_for(coroutine, timeout_s))
    except (TimeoutError, Exception):
        return 0.0
