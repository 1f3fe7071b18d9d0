"""What a replica reports for routing: a ``ReplicaReport`` of its own counts and its engine's,
sent to Serve in its wire form (no Serve here)."""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

import pytest

from prefixmesh.cache_registry.types import BlockHash, EventKind, PrefixKey, ReplicaId, Tier
from prefixmesh.config import load_config
from prefixmesh.replica.admission.holds import HoldSettings, ReplicaHolds
from prefixmesh.replica.engines.base import BlockChange, EngineLoad
from prefixmesh.replica.serving.deployment import ReplicaCore
from prefixmesh.wire import GenerateRequest, ReplicaCapacity, ReplicaReport, SamplingSettings

CAPACITY = ReplicaCapacity(
    prefill_tokens_per_s=9000.0, decode_step_s=0.02, max_batch_tokens=2048, kv_blocks=512
)


class _Engine:
    def __init__(self, capacity: ReplicaCapacity = CAPACITY) -> None:
        self._capacity = capacity

    def capacity(self) -> ReplicaCapacity:
        return self._capacity

    def load(self) -> EngineLoad:
        return EngineLoad(
            waiting_requests=1,
            running_requests=2,
            kv_usage=0.5,
            prefix_cache_hit_tokens=64,
            connector_stats=(("async_loads", 3), ("cpu_loads", 40), ("layer_loads", 5)),
        )

    def close(self) -> None:
        pass


def _server(capacity: ReplicaCapacity = CAPACITY, *overrides: str) -> ReplicaCore:
    publisher = SimpleNamespace(
        epoch=7,
        published_events=30,
        published_resets=2,
        resyncs=1,
        heartbeat_mismatches=0,
        reaped=2,
    )
    server = ReplicaCore(
        load_config(overrides=list(overrides)),
        ReplicaId("replica-a"),
        _Engine(capacity),  # type: ignore[arg-type]
        publisher,  # type: ignore[arg-type]
        holds=ReplicaHolds(HoldSettings(own_holds=True)),
    )
    # Requests in flight: two queued, one running, one finished.
    server._prefill_tokens = {"q1": 300, "q2": 200}
    server._prefill_attention_s = {}
    server._running = {"run1"}
    server._finished = deque(["done1"], maxlen=8)
    return server


def test_the_report_counts_what_reached_the_replica() -> None:
    report = _server().report()
    assert (report.queued_requests, report.running_requests) == (2, 1)
    assert report.pending_prefill_tokens == 500 and report.kv_usage == 0.5
    assert report.pending_attention_s == 0.0  # its engine reports no attention cost
    assert report.capacity == ReplicaCapacity(9000.0, 0.02, 2048, 512)
    assert set(report.seen_requests) == {"q1", "q2", "run1", "done1"}
    counters = report.counters
    assert (counters.epoch, counters.reaped_replicas, counters.prefix_cache_hit_tokens) == (
        7,
        2,
        64,
    )
    assert counters.engine_waiting_requests == 1 and counters.engine_running_requests == 2
    # The connector's loads by kind, for benchmarks behind the router (in step / beside).
    assert (counters.layer_loads, counters.async_loads) == (5, 3)


def test_a_replica_with_an_attention_cost_reports_its_queued_prompts_attention() -> None:
    server = _server(
        dataclasses.replace(CAPACITY, attn_s_per_token_pair=1e-9), "cache.block_size=100"
    )
    keys = PrefixKey(tuple(BlockHash(b) for b in range(500)), 100)
    # Nothing of the 50,000-token prompt held: all of it is priced, its pairs past what the
    # 2,048-token chunks' rate counts; a 300-token prompt fits one chunk: none.
    cold = GenerateRequest("long", tuple(range(50_000)), keys, SamplingSettings(1))
    assert server._attention_s(cold) == pytest.approx(50_000 * (25_000 - 1024) * 1e-9)
    short = GenerateRequest("short", tuple(range(300)), keys.head(3), SamplingSettings(1))
    assert server._attention_s(short) == 0.0
    # The engine holds the first 40,000 tokens: only the last 10,000 are priced (at their
    # context), a follow-up's question on a cached document almost nothing.
    server._resident.apply([BlockChange(EventKind.STORED, Tier.GPU, keys.block_hashes[:400])])
    assert server._attention_s(cold) == pytest.approx(10_000 * (45_000 - 1024) * 1e-9)
    server._prefill_attention_s = {"long": 0.4, "other": 1.1}
    assert server.report().pending_attention_s == pytest.approx(1.5)


def test_serve_gets_the_wire_form_of_the_report() -> None:
    server = _server()
    wire = server.record_routing_stats()
    assert ReplicaReport.from_wire(wire) == server.report()
    assert wire["resyncs"] == 1 and wire["published_resets"] == 2
    assert wire["capacity"]["kv_blocks"] == 512
