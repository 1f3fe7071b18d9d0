"""A replica's load as one router sees it: its latest ``ReplicaReport`` and this router's ledger,
combined by a ``LoadRule``, as the policy's ``ReplicaSnapshot``.

The rule depends on who else sends the replica requests and what the report counts, and is
chosen once per router (``load_rule``). The cluster simulator's fleet turns its engine models'
reports into snapshots here too (``snapshot_of`` with no ledger), so both see replicas the same
way.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.ledger import LedgerLoad
from prefixmesh.router.policy.base import ReplicaSnapshot
from prefixmesh.wire import ReplicaCapacity, ReplicaReport

LoadRule = Callable[[ReplicaReport, LedgerLoad], LedgerLoad]
NOTHING_ROUTED = LedgerLoad()


def report_plus_ledger(report: ReplicaReport, own: LedgerLoad) -> LedgerLoad:
    """The direct path: the report counts what reached the replica; the ledger holds only what
    this router sent that no report has listed yet (on its way, or just arrived)."""
    return LedgerLoad(
        report.queued_requests + own.queued_requests,
        report.running_requests + own.running_requests,
        report.pending_prefill_tokens + own.pending_prefill_tokens,
    )


def ledger_only(report: ReplicaReport, own: LedgerLoad) -> LedgerLoad:
    """The proxy path with one ingress: every request to the replicas passes through it, so the
    ledger is exact and current, while a report can be a second old (a stale report would
    charge a replica for requests it has finished, and push its prefix away)."""
    return own


def larger_of(report: ReplicaReport, own: LedgerLoad) -> LedgerLoad:
    """The proxy path with several ingresses: the others' load is only in the (lagging)
    reports, this one's is in its ledger at once."""
    return LedgerLoad(
        max(report.queued_requests, own.queued_requests),
        max(report.running_requests, own.running_requests),
        max(report.pending_prefill_tokens, own.pending_prefill_tokens),
    )


def load_rule(direct: bool, sole_router: bool, progress_pushed: bool = False) -> LoadRule:
    """``progress_pushed``: the replicas tell this router of first tokens and ends, so its
    ledger is as exact on the direct path as Serve's callbacks make it on the proxy path."""
    if direct and not progress_pushed:
        return report_plus_ledger
    return ledger_only if sole_router else larger_of


def snapshot_of(
    replica: ReplicaId,
    report: ReplicaReport,
    assumed: ReplicaCapacity,
    own: LedgerLoad = NOTHING_ROUTED,
    rule: LoadRule = report_plus_ledger,
) -> ReplicaSnapshot:
    """The replica as the policy weighs it; ``assumed`` stands in for a capacity it has not
    reported."""
    load = rule(report, own)
    capacity = report.capacity or assumed
    return ReplicaSnapshot(
        replica,
        capacity,
        load.queued_requests,
        load.running_requests,
        load.pending_prefill_tokens,
        report.active_kv_blocks(capacity),
    )
