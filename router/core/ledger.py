"""Router-side load accounting: what this router has sent to each replica and not yet seen
finish.

Replicas report their load only every ``routing_stats_period_s``; between reports, a burst
routed on stale numbers would pile onto one replica. The ledger counts every routing decision at
once (queued, pending prefill tokens), moves a request to running at its first token and drops
it at its end. Pure; the caller serialises access.

On the direct path requests reach replicas past Serve's handle, so no first-token or end
callback arrives. With the in-process registry the replicas send them instead
(``progressed``, ``replica/events/progress.py``), within a publish interval. Otherwise the replicas'
reports list the request ids they have seen
(``seen_requests``), and ``seen`` drops those entries (their load is in the report from then on,
their claim released), so the ledger holds what no report has listed yet and the router adds it
to the report. That is what is on its way to a replica and what reached it after its latest
report was taken, finished or not: a report reaches the router through Serve's controller a
second or more after it was taken, so a router sending short requests fast counts that second's
worth of them (an upper bound, never a count of what is queued now). An entry no report will
list (a routing call that fell back after deciding, a client that went away before HAProxy
forwarded it) goes once its replica lists a request of ours routed ``OVERTAKEN_S`` later, or
else expires.

It also carries the in-flight claim a decision took for its replica (delay-hit holds across
routers, ``holds.py``): the router that took a claim releases it, and this is where it learns
when, so every way an entry ends (first token, end, seen in a report, moved, expired) hands its
claim to ``release_claim``. A replica's report becomes the router's view of its load in
``replica_load.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash, ReplicaId

ReleaseClaim = Callable[[BlockHash, ReplicaId], object]
OVERTAKEN_S = 2.0
"""An entry a replica's report leaves out while it lists a request of ours routed this much
later never reached that replica: requests to one replica arrive in the order they were routed,
give or take a paused process (GC, a busy core) or a long prompt's tokenizing."""


def _later(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None or a >= b else b


@dataclass(slots=True)
class _Routed:
    replica: ReplicaId
    prefill_tokens: int
    running: bool = False
    claim: BlockHash | None = None
    routed_s: float | None = None


@dataclass(frozen=True, slots=True)
class LedgerLoad:
    queued_requests: int = 0
    running_requests: int = 0
    pending_prefill_tokens: int = 0
    pending_attention_s: float = 0.0
    """Only a replica's report says this (the ledger counts tokens, not their attention)."""


class LoadLedger:
    def __init__(self, release_claim: ReleaseClaim | None = None) -> None:
        self._requests: dict[str, _Routed] = {}
        self.release_claim = release_claim
        """Called (under the caller's lock, on whatever thread ended the entry) with a
        request's claim when the entry no longer needs it; it must not block."""

    def routed(
        self,
        request_id: str,
        replica: ReplicaId,
        prefill_tokens: int,
        claim: BlockHash | None = None,
        now_s: float | None = None,
    ) -> bool:
        """Record a decision; a retried decision for the same request moves it. True if new.
        ``now_s``: the router's clock, for ``expire`` (None: the entry never expires)."""
        old = self._requests.get(request_id)
        if old is not None:
            if old.replica == replica and claim is None:
                claim = old.claim  # routed again to the same replica: it still computes
            elif old.claim != claim:
                self._release(old)  # moved: the old replica will not compute it
        self._requests[request_id] = _Routed(replica, prefill_tokens, claim=claim, routed_s=now_s)
        return old is None

    def moved(self, request_id: str, replica: ReplicaId) -> bool:
        """A request decided for one replica went to ``replica`` instead (the router cut its
        decision short): its load moves, its claim is released. False: no such entry."""
        routed = self._requests.get(request_id)
        if routed is None:
            return False
        self._release(routed)
        routed.replica = replica
        return True

    def seen(self, request_ids: Iterable[str], by: ReplicaId | None = None) -> int:
        """Requests replica ``by`` reported as arrived (queued, running or finished there):
        their load is in its report now. Its entries routed ``OVERTAKEN_S`` before the newest
        request of ours it lists will never arrive there: they go too. Returns how many entries
        that dropped."""
        dropped = 0
        newest_s: float | None = None
        for request_id in request_ids:
            routed = self._requests.pop(request_id, None)
            if routed is not None:
                self._release(routed)
                dropped += 1
                newest_s = _later(newest_s, routed.routed_s)
        if by is not None and newest_s is not None:
            dropped += self._drop_overtaken(by, newest_s, queued_only=False)
        return dropped

    def progressed(
        self, by: ReplicaId, first_tokens: Iterable[str], finished: Iterable[str]
    ) -> int:
        """Replica ``by`` says which requests reached their first token and which ended (the
        direct path's stand-in for Serve's callbacks): as ``first_token`` and ``finished``, and
        its queued entries routed ``OVERTAKEN_S`` before the newest one that reached its first
        token will never arrive. Returns how many entries that dropped."""
        newest_s: float | None = None
        for request_id in first_tokens:
            routed = self._requests.get(request_id)
            if routed is not None:
                newest_s = _later(newest_s, routed.routed_s)
            self.first_token(request_id)
        for request_id in finished:
            self.finished(request_id)
        if newest_s is None:
            return 0
        return self._drop_overtaken(by, newest_s, queued_only=True)

    def _drop_overtaken(self, by: ReplicaId, newest_s: float, *, queued_only: bool) -> int:
        cutoff_s = newest_s - OVERTAKEN_S
        return self._drop(
            k
            for k, v in self._requests.items()
            if v.replica == by
            and v.routed_s is not None
            and v.routed_s < cutoff_s
            and not (queued_only and v.running)
        )

    def expire(self, now_s: float, older_than_s: float) -> int:
        """Drop entries routed more than ``older_than_s`` ago that no report ever listed."""
        return self._drop(
            k
            for k, v in self._requests.items()
            if v.routed_s is not None and now_s - v.routed_s > older_than_s
        )

    def _drop(self, request_ids: Iterable[str]) -> int:
        lost = list(request_ids)  # collected before the dict changes under the iteration
        for request_id in lost:
            self._release(self._requests.pop(request_id))
        return len(lost)

    def first_token(self, request_id: str) -> None:
        routed = self._requests.get(request_id)
        if routed is not None:
            routed.running = True
            routed.prefill_tokens = 0
            self._release(routed)

    def finished(self, request_id: str) -> None:
        routed = self._requests.pop(request_id, None)
        if routed is not None:
            self._release(routed)

    def _release(self, routed: _Routed) -> None:
        # The prefix is stored (first token) or never will be by this request (it ended).
        if routed.claim is not None and self.release_claim is not None:
            self.release_claim(routed.claim, routed.replica)
        routed.claim = None

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
