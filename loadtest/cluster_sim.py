"""The cluster simulator: discrete events over engine models, a real policy and a real registry.

No real time and no Ray. One heap orders registry deliveries, replica step ends and arrivals
(at equal times in that order, so a request arriving as a step ends sees its effects). Each
arrival is routed the way the Ray Serve adapter routes it:

1. snapshots of every replica (its engine model's load) and a ``RegistryView``: the registry's
   lookup for the prompt's key and the decayed traffic of the policy's prefix group;
2. ``policy.route``; the request goes to the first replica of the first tier (engines never
   refuse), held there if the decision says so;
3. speculative entries for the prompt's blocks on that replica (TTL from the registry config),
   a touch of the group's hotness with ``policy.traffic_weight``, ``policy.on_routed``.

Replicas publish their cache changes as sequence-numbered ``CacheEvent``s that reach the registry
``registry_lag_s`` later (0: at once). The registry is ``RegistryState`` (the in-process registry's
core) on the simulation clock. A follow-up turn arrives its think time after its parent finishes.
Nothing here is random: the same workload, policy seed and config give identical results.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixmesh.cache_registry.memory import RegistryState
from prefixmesh.cache_registry.types import SHARED_TIER, CacheEvent, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.loadtest.fleet import SimReplica
from prefixmesh.loadtest.keys import KeyBuilder
from prefixmesh.loadtest.workloads import WorkloadRequest
from prefixmesh.replica.kvcache.policy import Clock, TierPolicy
from prefixmesh.replica.sim_model.prefix_cache import SharedTier, to_events
from prefixmesh.replica.sim_model.profile import EngineProfile
from prefixmesh.replica.sim_model.records import (
    CacheChanged,
    EngineEvent,
    Finished,
    RequestRecord,
    SimRequest,
)
from prefixmesh.router.policy.base import RouteRequest, RoutingPolicy, registry_view

_DELIVER, _ENGINE, _ARRIVAL = range(3)


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: EngineProfile
    tp_degrees: tuple[int, ...]
    """One entry per replica: its tensor-parallel degree."""
    registry_lag_s: float = 0.05
    """Delay from a replica's cache change to the registry applying it (KV events over ZMQ,
    a subscriber, a pipelined Redis write: tens of milliseconds)."""
    speculative_ttl_s: float = 2.0
    """Lifetime of routing-time entries (RegistryConfig.speculative_ttl_s)."""
    hotness_half_life_s: float = 30.0
    max_holders_per_block: int = 64
    key_seed: int = 0
    """Seed of the content hash chains (any value; equal across policies of one comparison)."""
    shared_blocks: int = 0
    """Capacity of the cluster's shared tier, in blocks (0: none). Every replica writes the
    blocks it computes there and loads from it at its profile's ``shared_load_s_per_block``;
    the registry records it once (``SHARED_TIER``), with the same lag as a replica's events."""
    cpu_policy: Callable[[Clock], TierPolicy] | None = None
    """A fresh policy for each replica's CPU tier, given the simulation's clock (None: LRU)."""

    @classmethod
    def uniform(
        cls, profile: EngineProfile, replicas: int, tp_degree: int = 1, **options: Any
    ) -> SimConfig:
        return cls(profile, (tp_degree,) * replicas, **options)

    @property
    def num_replicas(self) -> int:
        return len(self.tp_degrees)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    record: RequestRecord
    replica: int
    reason: str
    """The policy's label for the decision."""
    held: bool
    kind: str


@dataclass(slots=True)
class SimResult:
    policy: str
    outcomes: list[RequestOutcome]
    """In arrival order."""
    busy_s: list[float]
    """Per replica: time spent running steps."""
    steps: list[int]
    """Per replica: engine steps run."""
    events: int
    """Simulation events processed (a measure of the simulator's own work)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def start_s(self) -> float:
        return min((o.record.arrival_s for o in self.outcomes), default=0.0)

    @property
    def end_s(self) -> float:
        return max((o.record.finish_s or 0.0 for o in self.outcomes), default=0.0)


class ClusterSim:
    """One run of one policy over one workload."""

    def __init__(self, config: SimConfig, policy: RoutingPolicy) -> None:
        if not config.tp_degrees:
            raise ValueError("the fleet needs at least one replica")
        self.config = config
        self.policy = policy
        self.now_s = 0.0
        self.registry = RegistryState(
            clock=lambda: self.now_s,
            max_holders_per_block=config.max_holders_per_block,
            hotness_half_life_s=config.hotness_half_life_s,
        )
        self.shared = SharedTier(config.shared_blocks) if config.shared_blocks else None
        self._shared_seq = 0
        make_cpu_policy = config.cpu_policy
        self.replicas = [
            SimReplica(
                i,
                config.profile,
                tp,
                self.shared,
                cpu_policy=None if make_cpu_policy is None else make_cpu_policy(self._now),
            )
            for i, tp in enumerate(config.tp_degrees)
        ]
        self._by_id = {r.replica_id: r for r in self.replicas}
        self.keys = KeyBuilder(config.profile.block_size, config.key_seed)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._versions = [0] * len(self.replicas)
        self._scheduled: list[float | None] = [None] * len(self.replicas)
        self._routed: dict[str, tuple[RouteRequest, SimReplica, str, bool, str]] = {}
        self._followers: dict[str, list[WorkloadRequest]] = {}
        self._outcomes: dict[str, RequestOutcome] = {}
        self._events = 0
        self._snapshots = [r.snapshot() for r in self.replicas]
        self._dirty: set[int] = set()
        """Replicas whose engine changed since the last routing decision."""

    # ---- the loop ----------------------------------------------------------------------------

    def _now(self) -> float:
        return self.now_s

    def run(self, requests: Sequence[WorkloadRequest]) -> SimResult:
        arrivals = sorted((r for r in requests if r.follows is None), key=lambda r: r.arrival_s)
        for request in requests:
            if request.follows is not None:
                self._followers.setdefault(request.follows, []).append(request)
        heap = self._heap
        next_arrival = 0
        while True:
            arrival_s = (
                arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) else math.inf
            )
            if heap and heap[0][0] <= arrival_s:
                time_s, kind, _, payload = heapq.heappop(heap)
            elif next_arrival < len(arrivals):
                time_s, kind, payload = arrival_s, _ARRIVAL, arrivals[next_arrival]
                next_arrival += 1
            else:
                break
            self._events += 1
            self.now_s = time_s
            if kind == _ENGINE:
                index, version = payload
                if version == self._versions[index]:
                    self._scheduled[index] = None
                    replica = self.replicas[index]
                    self._handle(replica, replica.engine.advance(time_s))
                    self._reschedule(replica)
            elif kind == _ARRIVAL:
                self._arrive(payload)
            else:
                self.registry.publish(payload)
        return self._result(requests)

    def _push(self, time_s: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time_s, kind, self._seq, payload))

    def _reschedule(self, replica: SimReplica) -> None:
        next_s = replica.engine.next_event_s()
        index = replica.index
        self._dirty.add(index)
        if next_s != self._scheduled[index]:
            self._versions[index] += 1
            self._scheduled[index] = next_s
            if next_s is not None:
                self._push(next_s, _ENGINE, (index, self._versions[index]))

    # ---- arrivals ----------------------------------------------------------------------------

    def _arrive(self, request: WorkloadRequest) -> None:
        now = self.now_s
        policy, registry = self.policy, self.registry
        key = self.keys.key(request.segments)
        route_request = RouteRequest(
            request.request_id, key, request.prompt_tokens, request.output_tokens
        )
        snapshots = self._snapshots
        for index in self._dirty:
            snapshots[index] = self.replicas[index].snapshot()
        self._dirty.clear()
        hits = registry.lookup(key, ()) if key.block_hashes else {}
        group = policy.prefix_group(route_request)
        group_rate = registry.rate(group) if group is not None else 0.0
        decision = policy.route(route_request, snapshots, registry_view(hits, group_rate), now)
        replica = self._by_id[decision.chosen]
        ttl_s = decision.speculative_ttl_s(self.config.speculative_ttl_s)
        self._speculate(key, replica.replica_id, hits.get(replica.replica_id), ttl_s)
        if group is not None:
            registry.touch(group, policy.traffic_weight(route_request))
        policy.on_routed(route_request, replica.replica_id, now)
        hold = decision.hold
        engine_request = SimRequest(
            request.request_id,
            key,
            request.prompt_tokens,
            request.output_tokens,
            self._finish_key(request, key),
        )
        self._routed[request.request_id] = (
            route_request,
            replica,
            decision.reason,
            hold is not None,
            request.kind,
        )
        engine = replica.engine
        self._handle(replica, engine.advance(now))  # nothing is due: step ends come first
        engine.submit(engine_request, now, hold)
        self._reschedule(replica)

    def _speculate(
        self, key: PrefixKey, replica_id: ReplicaId, hit: PrefixHit | None, ttl_s: float
    ) -> None:
        """Speculative entries for the blocks the replica is not known to hold for sure.

        When the view showed its leading blocks confirmed (no speculative part), only the blocks
        after them need entries: a lookup walks the confirmed run, then the speculative one. This
        is what the adapter does against Redis too (fewer writes), and it keeps the registry's
        per-block speculative sets small."""
        hashes = key.block_hashes
        confirmed = hit.num_blocks if hit is not None and not hit.num_speculative else 0
        if confirmed < len(hashes):
            self.registry.add_speculative(
                PrefixKey(hashes[confirmed:], key.block_size),
                replica_id,
                ttl_s,
            )

    def _finish_key(self, request: WorkloadRequest, key: PrefixKey) -> PrefixKey | None:
        if request.finish_segments is None:
            return None
        finish = self.keys.key(request.finish_segments)
        limit = (request.prompt_tokens + request.output_tokens) // self.keys.block_size
        if finish.block_hashes[: len(key)] != key.block_hashes or len(finish) > limit:
            return None  # an answer that does not extend this prompt is not cached
        return finish

    # ---- engine events -------------------------------------------------------------------------

    def _handle(self, replica: SimReplica, events: list[EngineEvent]) -> None:
        for event in events:
            if isinstance(event, CacheChanged):
                published = to_events(event.changes, replica.replica_id, replica.seq)
                replica.seq += len(published)
                self._deliver(event.time_s, published)
            elif isinstance(event, Finished):
                self._finished(replica.replica_id, event)
        if self.shared is not None:
            self._deliver(self.now_s, self._shared_events())

    def _shared_events(self) -> list[CacheEvent]:
        assert self.shared is not None
        published = to_events(self.shared.take_changes(), SHARED_TIER, self._shared_seq)
        self._shared_seq += len(published)
        return published

    def _deliver(self, time_s: float, events: list[CacheEvent]) -> None:
        if not events:
            return
        lag = self.config.registry_lag_s
        if lag > 0:
            self._push(time_s + lag, _DELIVER, events)
        else:
            self.registry.publish(events)

    def _finished(self, replica_id: ReplicaId, event: Finished) -> None:
        record = event.record
        route_request, replica, reason, held, kind = self._routed.pop(record.request_id)
        self._outcomes[record.request_id] = RequestOutcome(
            record, replica.index, reason, held, kind
        )
        self.policy.on_finished(route_request, replica_id, event.time_s)
        for child in self._followers.pop(record.request_id, ()):
            self._push(event.time_s + child.think_s, _ARRIVAL, child)

    def _result(self, requests: Sequence[WorkloadRequest]) -> SimResult:
        missing = [r.request_id for r in requests if r.request_id not in self._outcomes]
        if missing:
            raise RuntimeError(f"{len(missing)} requests never finished, e.g. {missing[:3]}")
        outcomes = sorted(self._outcomes.values(), key=lambda o: o.record.arrival_s)
        return SimResult(
            policy=self.policy.name,
            outcomes=outcomes,
            busy_s=[r.engine.busy_s for r in self.replicas],
            steps=[r.engine.steps for r in self.replicas],
            events=self._events,
        )
