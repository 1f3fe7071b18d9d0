"""Simulated replicas as the router sees them: capacity and load snapshots from engine models.

This is where replica-side values (``EngineProfile``, ``EngineLoad``) become the router's
(``ReplicaCapacity``, ``ReplicaSnapshot``): replica/ does not import router/ (DESIGN.md section 4),
loadtest/ may import both.
"""

from __future__ import annotations

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.replica.model.engine import EngineLoad, EngineModel
from prefixmesh.replica.model.profile import EngineProfile
from prefixmesh.router.policy.base import ReplicaCapacity, ReplicaSnapshot


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
    )


class SimReplica:
    """One replica of the simulated fleet: an engine model, its id and its capacity."""

    __slots__ = ("_load", "_snapshot", "capacity", "engine", "index", "replica_id", "seq")

    def __init__(self, index: int, profile: EngineProfile, tp_degree: int = 1) -> None:
        self.index = index
        self.replica_id = ReplicaId(f"replica-{index}")
        self.engine = EngineModel(profile, tp_degree)
        self.capacity = capacity(profile, tp_degree)
        self.seq = 0
        """Next cache-event sequence number."""
        self._load: EngineLoad | None = None
        self._snapshot: ReplicaSnapshot | None = None

    def snapshot(self) -> ReplicaSnapshot:
        load = self.engine.load()
        if load is not self._load or self._snapshot is None:
            self._load = load
            self._snapshot = ReplicaSnapshot(
                replica_id=self.replica_id,
                capacity=self.capacity,
                queued_requests=load.queued_requests,
                running_requests=load.running_requests,
                pending_prefill_tokens=load.pending_prefill_tokens,
                active_kv_blocks=load.active_kv_blocks,
            )
        return self._snapshot
