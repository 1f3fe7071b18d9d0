"""Router-side load accounting: what this router has sent to each replica and not yet seen
finish.

Replicas report their load only every ``routing_stats_period_s``; between reports, a burst
routed on stale numbers would pile onto one replica. The ledger counts every routing decision at
once (queued, pending prefill tokens), moves a request to running at its first token and drops
it at its end. Pure; the caller serialises access.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.cache_registry.types import ReplicaId


@dataclass(slots=True)
class _Routed:
    replica: ReplicaId
    prefill_tokens: int
    running: bool = False


@dataclass(frozen=True, slots=True)
class LedgerLoad:
    queued_requests: int = 0
    running_requests: int = 0
    pending_prefill_tokens: int = 0


class LoadLedger:
    def __init__(self) -> None:
        self._requests: dict[str, _Routed] = {}

    def routed(self, request_id: str, replica: ReplicaId, prefill_tokens: int) -> bool:
        """Record a decision; a retried decision for the same request moves it. True if new."""
        new = request_id not in self._requests
        self._requests[request_id] = _Routed(replica, prefill_tokens)
        return new

    def first_token(self, request_id: str) -> None:
        routed = self._requests.get(request_id)
        if routed is not None:
            routed.running = True
            routed.prefill_tokens = 0

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def replica_of(self, request_id: str) -> ReplicaId | None:
        routed = self._requests.get(request_id)
        return None if routed is None else routed.replica

    def load(self) -> dict[ReplicaId, LedgerLoad]:
        totals: dict[ReplicaId, list[int]] = {}
        for routed in self._requests.values():
            row = totals.setdefault(routed.replica, [0, 0, 0])
            row[1 if routed.running else 0] += 1
            row[2] += routed.prefill_tokens
        return {replica: LedgerLoad(q, r, p) for replica, (q, r, p) in totals.items()}

    def forget_replica(self, replica: ReplicaId) -> None:
        for request_id in [k for k, v in self._requests.items() if v.replica == replica]:
            del self._requests[request_id]

    def __len__(self) -> int:
        return len(self._requests)
