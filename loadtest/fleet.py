"""Simulated replicas as the router sees them: capacity and load snapshots from engine models.

A simulated replica reports what a real one does, a ``ReplicaReport`` (its capacity from its
``EngineProfile``, its load from its ``ModelLoad``), and the router turns it into the policy's
``ReplicaSnapshot`` in the same place it turns a real replica's report (``replica_load``).
replica/ does not import router/ (docs/design.md section 4); loadtest/ may import both.
"""

from __future__ import annotations

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.replica.kvcache.policy import TierPolicy
from prefixmesh.replica.sim_model.engine import EngineModel
from prefixmesh.replica.sim_model.prefix_cache import SharedTier
from prefixmesh.replica.sim_model.profile import EngineProfile
from prefixmesh.replica.sim_model.records import ModelLoad
from prefixmesh.router.core.replica_load import snapshot_of
from prefixmesh.router.policy.base import ReplicaSnapshot
from prefixmesh.wire import ReplicaCapacity, ReplicaReport


def capacity(profile: EngineProfile, tp_degree: int = 1) -> ReplicaCapacity:
    """What a replica of ``profile`` at ``tp_degree`` reports, consistent with its step model:
    the prefill rate is a full prefill step at zero context, the decode step a batch of one at
    zero context."""
    speedup = profile.tp_speedup(tp_degree)
    return ReplicaCapacity(
        prefill_tokens_per_s=profile.prefill_tokens_per_s(tp_degree),
        decode_step_s=profile.decode_step_s(1, 0, tp_degree),
        max_batch_tokens=profile.max_batch_tokens,
        kv_blocks=profile.kv_blocks_at(tp_degree),
        tp_degree=tp_degree,
        cpu_load_s_per_block=profile.cpu_load_s_per_block / speedup if profile.cpu_blocks else 0.0,
        shared_load_s_per_block=profile.shared_load_s_per_block / speedup,
        attn_s_per_token_pair=profile.attn_s_per_token_ctx / speedup,
    )


def report(load: ModelLoad, capacity: ReplicaCapacity) -> ReplicaReport:
    """The report of a replica with this load: the router's view of it, exact and current."""
    return ReplicaReport(
        queued_requests=load.queued_requests,
        running_requests=load.running_requests,
        pending_prefill_tokens=load.pending_prefill_tokens,
        pending_attention_s=load.pending_attention_s,
        kv_usage=load.active_kv_blocks / capacity.kv_blocks if capacity.kv_blocks else 0.0,
        capacity=capacity,
    )


class SimReplica:
    """One replica of the simulated fleet: an engine model, its id and its capacity."""

    __slots__ = ("_load", "_snapshot", "capacity", "engine", "index", "replica_id", "seq")

    def __init__(
        self,
        index: int,
        profile: EngineProfile,
        tp_degree: int = 1,
        shared: SharedTier | None = None,
        *,
        cpu_policy: TierPolicy | None = None,
    ) -> None:
        self.index = index
        self.replica_id = ReplicaId(f"replica-{index}")
        self.engine = EngineModel(profile, tp_degree, shared, cpu_policy=cpu_policy)
        self.capacity = capacity(profile, tp_degree)
        self.seq = 0
        """Next cache-event sequence number."""
        self._load: ModelLoad | None = None
        self._snapshot: ReplicaSnapshot | None = None

    def snapshot(self) -> ReplicaSnapshot:
        load = self.engine.load()
        if load is not self._load or self._snapshot is None:
            self._load = load
            self._snapshot = snapshot_of(
                self.replica_id, report(load, self.capacity), self.capacity
            )
        return self._snapshot
