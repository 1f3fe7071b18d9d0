"""A replica's report as the router weighs it: one rule per router kind for adding its own
ledger, the configured capacity until the replica reports one, reports converted once each and
applied to the ledger once each, the simulator's fleet through the same conversion, and
measured capacities pooled within their noise."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefixmesh.cache_registry.factory import make_memory_state
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import load_config
from prefixmesh.loadtest.fleet import SimReplica, report
from prefixmesh.replica.sim_model.profile import H100_LLAMA8B
from prefixmesh.router.core.ledger import OVERTAKEN_S, LedgerLoad
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.router.core.replica_load import (
    larger_of,
    ledger_only,
    load_rule,
    pooled_capacities,
    report_plus_ledger,
    snapshot_of,
)
from prefixmesh.router.policy.base import ReplicaSnapshot
from prefixmesh.wire import ReplicaCapacity, ReplicaReport

R = ReplicaId("r1")
ASSUMED = ReplicaCapacity(1000.0, 0.05, 512, 1)
OWN = ReplicaCapacity(8000.0, 0.02, 2048, 400, 2)
REPORT = ReplicaReport(3, 1, 900, pending_attention_s=0.7, kv_usage=0.5, capacity=OWN)
LEDGER = LedgerLoad(1, 2, 100)


def test_each_router_kind_adds_its_ledger_its_own_way() -> None:
    assert load_rule(direct=True, sole_router=True) is report_plus_ledger
    assert load_rule(direct=False, sole_router=True) is ledger_only
    assert load_rule(direct=False, sole_router=False) is larger_of
    # The ledger counts tokens only: the prompts' attention comes from the report, if at all.
    assert report_plus_ledger(REPORT, LEDGER) == LedgerLoad(4, 3, 1000, 0.7)
    assert ledger_only(REPORT, LEDGER) == LEDGER
    assert larger_of(REPORT, LEDGER) == LedgerLoad(3, 2, 900, 0.7)


def test_a_snapshot_takes_the_reported_capacity_else_the_assumed_one() -> None:
    snapshot = snapshot_of(R, REPORT, ASSUMED, LEDGER, larger_of)
    assert snapshot == ReplicaSnapshot(
        R, OWN, 3, 2, 900, active_kv_blocks=200, pending_attention_s=0.7
    )
    blind = snapshot_of(R, ReplicaReport(kv_usage=0.5), ASSUMED)
    assert blind == ReplicaSnapshot(R, ASSUMED, 0, 0, 0, active_kv_blocks=0)


def test_the_fleet_reports_through_the_same_conversion() -> None:
    replica = SimReplica(2, replace(H100_LLAMA8B, kv_blocks=100))
    load = replica.engine.load()
    sent = report(load, replica.capacity)
    assert sent.capacity == replica.capacity
    assert replica.snapshot() == snapshot_of(replica.replica_id, sent, ASSUMED)
    assert replica.snapshot().active_kv_blocks == load.active_kv_blocks


def local() -> LocalRouterState:
    return LocalRouterState(make_memory_state(load_config()))


def test_serves_report_dicts_are_converted_once_each() -> None:
    state = local()
    stats: dict[str, Any] = {"queued_requests": 2, "seen_requests": ["a"]}
    first = state.report(R, stats)
    assert first == ReplicaReport(queued_requests=2, seen_requests=("a",))
    assert state.report(R, stats) is first  # the same dict: no second conversion
    newer = state.report(R, {**stats, "queued_requests": 3})  # Serve's next poll
    assert newer is not first and newer.queued_requests == 3
    assert state.report(R, None) == ReplicaReport()  # before the first report


def test_each_report_drops_what_it_lists_once() -> None:
    state = local()
    state.ledger.routed("a", R, 100, now_s=0.0)
    state.ledger.routed("b", R, 100, now_s=0.0)
    listed = ReplicaReport(seen_requests=("a",))
    state.apply_reports([(R, listed)], now_s=1.0, expiry_s=60.0)
    assert len(state.ledger) == 1
    # Routed again under the same id after the report: the same report must not drop it.
    state.ledger.routed("a", R, 100, now_s=2.0)
    state.apply_reports([(R, listed)], now_s=3.0, expiry_s=60.0)
    assert len(state.ledger) == 2
    # A report in its wire form (``replica_stats``) is read as well; old entries expire.
    state.apply_reports([(R, {"seen_requests": ["a"]})], now_s=61.0, expiry_s=60.0)
    assert len(state.ledger) == 0


def test_a_decision_whose_request_never_arrives_stops_counting_once_overtaken() -> None:
    """A routing call that times out after the decision was recorded answers HAProxy with a
    load-balanced pick and no ticket: the replica serves the request under an id of its own, so
    no report lists the decision's. It stops counting on its replica as soon as that replica's
    report lists a request of ours routed OVERTAKEN_S later, not at the 600 s expiry."""
    state = local()
    state.ledger.routed("fell-back", R, 100, now_s=0.0)
    state.ledger.routed("served", R, 100, now_s=OVERTAKEN_S + 1.0)
    reports = [(R, ReplicaReport(queued_requests=1, seen_requests=("served", "own-id")))]
    state.apply_reports(reports, now_s=OVERTAKEN_S + 1.5, expiry_s=600.0)
    assert len(state.ledger) == 0
    snapshot = snapshot_of(R, reports[0][1], ASSUMED, state.ledger.load().get(R, LedgerLoad()))
    assert snapshot.queued_requests == 1  # the report's, and nothing of the ledger's


def test_with_progress_pushed_the_direct_path_weighs_the_ledger_alone() -> None:
    assert load_rule(direct=True, sole_router=True, progress_pushed=True) is ledger_only
    assert load_rule(direct=True, sole_router=False, progress_pushed=False) is report_plus_ledger


def test_with_progress_pushed_reports_drop_nothing_and_progress_moves_the_ledger() -> None:
    """A report lists requests that are still running: with the replicas' progress keeping the
    ledger exact, dropping them would make the replica look idle."""
    from prefixmesh.wire.request_progress import RequestProgress

    state = local()
    state.ledger.routed("a", R, 100, now_s=0.0)
    state.ledger.routed("b", R, 200, now_s=0.0)
    listed = ReplicaReport(seen_requests=("a", "b"))
    state.apply_reports([(R, listed)], now_s=1.0, expiry_s=60.0, progress_pushed=True)
    assert state.ledger.load()[R] == LedgerLoad(2, 0, 300)
    state.apply_progress(RequestProgress(R, first_tokens=("a",), finished=()))
    assert state.ledger.load()[R] == LedgerLoad(1, 1, 200)
    state.apply_progress(RequestProgress(R, first_tokens=("b",), finished=("a", "b")))
    assert len(state.ledger) == 0
    # An entry whose end never comes still expires.
    state.ledger.routed("lost", R, 100, now_s=2.0)
    state.apply_reports([], now_s=63.0, expiry_s=60.0, progress_pushed=True)
    assert len(state.ledger) == 0


def test_capacities_within_their_noise_are_pooled_per_tensor_parallel_degree() -> None:
    a = ReplicaCapacity(24403.0, 0.012, 8192, 60)
    b = ReplicaCapacity(27223.0, 0.010, 8192, 64)
    c = ReplicaCapacity(26000.0, 0.020, 8192, 60)  # its decode step is past the band
    tp2 = ReplicaCapacity(50000.0, 0.008, 8192, 120, tp_degree=2)  # alone at its degree
    pooled = pooled_capacities([a, b, c, tp2], 0.25)
    assert [p.prefill_tokens_per_s for p in pooled] == [26000.0, 26000.0, 26000.0, 50000.0]
    assert [p.decode_step_s for p in pooled] == [0.012, 0.012, 0.020, 0.008]
    assert [p.kv_blocks for p in pooled] == [60, 64, 60, 120]  # only the timed fields move
    assert pooled[3] is tp2
    # Another GPU (twice as fast) is no noise: both keep their own numbers.
    slow = ReplicaCapacity(10000.0, 0.02, 8192, 60)
    assert pooled_capacities([slow, replace(slow, prefill_tokens_per_s=20000.0)], 0.25) == [
        slow,
        replace(slow, prefill_tokens_per_s=20000.0),
    ]
    assert pooled_capacities([a, b], 0.0) == [a, b]


def test_a_broken_capacity_is_neither_pooled_nor_counted_in_the_median() -> None:
    good = ReplicaCapacity(20000.0, 0.01, 8192, 60)
    broken = ReplicaCapacity(0.0, 0.01, 8192, 60)
    pooled = pooled_capacities([good, replace(good, prefill_tokens_per_s=22000.0), broken], 0.25)
    assert [p.prefill_tokens_per_s for p in pooled] == [21000.0, 21000.0, 0.0]
