"""The replica's report and its one wire conversion: a round trip keeps every field, the keys
tests and benchmarks read stay flat, and anything missing or garbled reads as its default."""

from __future__ import annotations

from typing import Any

import pytest

from prefixmesh.wire import ReplicaCapacity, ReplicaCounters, ReplicaReport

CAPACITY = ReplicaCapacity(
    10_000.0, 0.02, 2048, 1000, 2, cpu_load_s_per_block=0.001, attn_s_per_token_pair=1e-9
)
REPORT = ReplicaReport(
    queued_requests=2,
    running_requests=3,
    pending_prefill_tokens=700,
    pending_attention_s=1.25,
    kv_usage=0.25,
    capacity=CAPACITY,
    seen_requests=("a", "b"),
    counters=ReplicaCounters(epoch=9, holds=4, resyncs=1, prefix_cache_hit_tokens=128),
)


def test_a_report_survives_its_wire_form() -> None:
    wire = REPORT.to_wire()
    assert ReplicaReport.from_wire(wire) == REPORT
    # What Serve hands the routers and what tests and benchmarks read: flat keys, lists.
    assert wire["queued_requests"] == 2 and wire["holds"] == 4 and wire["epoch"] == 9
    assert wire["seen_requests"] == ["a", "b"]
    assert wire["capacity"]["prefill_tokens_per_s"] == 10_000.0
    assert ReplicaCapacity.from_wire(wire["capacity"]) == CAPACITY


@pytest.mark.parametrize("raw", [None, {}, "garbage", []])
def test_nothing_readable_is_an_empty_report(raw: object) -> None:
    assert ReplicaReport.from_wire(raw) == ReplicaReport()


def test_garbled_fields_read_as_their_defaults() -> None:
    raw: dict[str, Any] = {
        "queued_requests": "3",  # a number in a string is still a number
        "running_requests": "many",
        "pending_prefill_tokens": None,
        "pending_attention_s": float("inf"),
        "kv_usage": float("nan"),
        "holds": float("inf"),
        "seen_requests": "r1",  # not a list
        "replica_id": "r7",  # what ``replica_stats`` adds: ignored
    }
    report = ReplicaReport.from_wire(raw)
    assert (report.queued_requests, report.running_requests) == (3, 0)
    assert report.pending_prefill_tokens == 0 and report.seen_requests == ()
    assert report.kv_usage == 0.0 and report.pending_attention_s == 0.0
    assert report.counters.holds == 0 and report.capacity is None


def test_a_capacity_needs_its_four_fields_and_at_least_one_block() -> None:
    core = {
        "prefill_tokens_per_s": 5000,
        "decode_step_s": 0.01,
        "max_batch_tokens": 512,
        "kv_blocks": 0,
    }
    assert ReplicaCapacity.from_wire(core) == ReplicaCapacity(5000.0, 0.01, 512, 1)
    for missing in core:
        partial = {k: v for k, v in core.items() if k != missing}
        assert ReplicaCapacity.from_wire(partial) is None
    assert ReplicaCapacity.from_wire({**core, "decode_step_s": "slow"}) is None
    assert ReplicaCapacity.from_wire({**core, "prefill_tokens_per_s": float("inf")}) is None
    assert ReplicaReport.from_wire({"capacity": {"kv_blocks": 4}}).capacity is None


def test_an_engine_s_own_capacity_has_a_block_and_says_whether_it_is_usable() -> None:
    """Review of issue 37: an engine's capacity no longer went through ``from_wire``, which
    had kept a block and dropped a rate that is not finite."""
    assert ReplicaCapacity(5000.0, 0.01, 512, 0).kv_blocks == 1
    assert ReplicaCapacity(5000.0, 0.01, 512, 8).usable()
    assert not ReplicaCapacity(float("inf"), 0.01, 512, 8).usable()
    assert not ReplicaCapacity(5000.0, 0.01, 512, 8, shared_load_s_per_block=float("nan")).usable()


def test_active_blocks_come_back_as_sent() -> None:
    for blocks in range(0, 1001, 7):
        report = ReplicaReport(kv_usage=blocks / 1000, capacity=CAPACITY)
        assert report.active_kv_blocks(CAPACITY) == blocks
