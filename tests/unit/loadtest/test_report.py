"""The load-test report on synthetic results: exact numbers, the files, and the comparison's
table from the replicas' counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.loadtest.compare_report import (
    delta,
    make_row,
    parse_counters,
    replica_ttft_p50,
    table,
    write_compare,
)
from prefixmesh.loadtest.report import (
    REQUIRED_KEYS,
    ClientRecord,
    prefix_cache_counters,
    summarize,
    write_report,
)


def record(i: int, ttft: float | None = 0.1, error: str = "", cached: int = 50) -> ClientRecord:
    sent = i * 0.5
    return ClientRecord(
        id=f"r{i}",
        kind="group",
        scheduled_s=sent - 0.001,
        sent_s=sent,
        end_s=sent + 1.0,
        ttft_s=ttft,
        e2e_s=1.0,
        itl_s=[0.01, 0.03],
        prompt_tokens=100,
        cached_tokens=cached,
        completion_tokens=10,
        status=200 if not error else 503,
        error=error,
    )


def synthetic() -> tuple[list[ClientRecord], list[tuple[float, float]]]:
    records = [record(i, ttft=0.1 * (i + 1)) for i in range(10)]
    records.append(record(10, ttft=None, error="engine failed"))
    launches = [(r.scheduled_s, r.sent_s) for r in records]
    return records, launches


def test_summary_numbers() -> None:
    records, launches = synthetic()
    summary = summarize(records, launches)
    assert summary["requests"] == 11 and summary["failures"] == 1
    assert summary["ttft_p50_s"] == pytest.approx(0.55)
    assert summary["ttft_p90_s"] == pytest.approx(0.91)
    assert summary["itl_p50_s"] == pytest.approx(0.02)
    assert summary["throughput_tok_s"] == pytest.approx(100 / 6.0, rel=1e-3)  # 0 .. 6 s
    assert summary["hit_rate"] == 0.5 and summary["hit_rate_source"] == "usage"
    assert summary["arrival_cv"] == 0.0  # launches every 0.5 s exactly
    assert summary["launch_drift_p99_ms"] == pytest.approx(1.0)
    assert summary["errors"] == {"engine failed": 1}


def test_hit_rate_comes_from_the_replicas_counters_when_given() -> None:
    records, launches = synthetic()
    before = {"a": (100.0, 10.0), "b": (0.0, 0.0)}
    after = {"a": (1100.0, 810.0), "b": (1000.0, 200.0)}
    summary = summarize(records, launches, before, after)
    assert summary["hit_rate"] == 0.5  # (800 + 200) / (1000 + 1000)
    assert summary["hit_rate_source"] == "replica counters"
    assert summary["usage_hit_rate"] == 0.5


def test_prometheus_counters_are_summed_over_labels() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prefix_cache_queries_total counter",
            'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 300',
            'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 100',
            'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 1.5e2',
            "vllm:prefix_cache_hits_created 12",
        ]
    )
    assert prefix_cache_counters(text) == (400.0, 150.0)


def test_report_files(tmp_path: Path) -> None:
    records, launches = synthetic()
    meta = {"target": "http://127.0.0.1:1", "plan": {"workload": "groups", "rate": 2.0}}
    write_report(tmp_path, records, launches, meta)
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report)[: len(REQUIRED_KEYS)] == list(REQUIRED_KEYS)
    assert report["meta"]["target"] == "http://127.0.0.1:1"
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 11 and json.loads(lines[0])["id"] == "r0"
    for png in ("ttft_cdf.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "report.md").read_text()
    assert "| ttft_p99_s |" in markdown and "groups at 2.0 req/s" in markdown


METRICS = """
vllm:prefix_cache_queries_total{{model_name="m",engine="0"}} {q}
vllm:prefix_cache_hits_total{{model_name="m",engine="0"}} {h}
prefixmesh_replica_requests_total{{replica="r"}} {n}
prefixmesh_replica_engine_busy_seconds_total{{replica="r"}} {b}
prefixmesh_replica_ttft_seconds_sum{{replica="r"}} {t}
prefixmesh_replica_ttft_seconds_count{{replica="r"}} {n}
prefixmesh_replica_ttft_seconds_bucket{{replica="r",le="0.05"}} {fast}
prefixmesh_replica_ttft_seconds_bucket{{replica="r",le="0.1"}} {n}
"""


def test_replica_median_without_buckets_is_unknown() -> None:
    assert replica_ttft_p50([{"ttft_count": 4.0}]) is None
    assert replica_ttft_p50([{"ttft_count": 0.0, "ttft_le:0.1": 0.0}]) is None


def test_a_comparison_row_from_replica_counters(tmp_path: Path) -> None:
    zero = parse_counters(METRICS.format(q=0, h=0, n=0, b=0, t=0, fast=0))
    ends = [
        parse_counters(METRICS.format(q=1000, h=900, n=10, b=3.0, t=1.0, fast=10)),
        parse_counters(METRICS.format(q=1000, h=500, n=30, b=1.0, t=3.0, fast=5)),
    ]
    deltas = delta([zero, zero], ends)
    report = {"requests": 40, "failures": 0, "ttft_mean_s": 0.15, "ttft_p50_s": 0.1,
              "ttft_p99_s": 0.9, "throughput_tok_s": 50.0, "arrival_cv": 1.0}  # fmt: skip
    row = make_row("ours", "setup", report, deltas, 12.5, (1.0, 2.0))
    assert row.hit_rate == 0.7
    assert row.load_imbalance == 1.5  # busy 3 and 1: max / mean
    assert row.overhead_loaded_ms == pytest.approx(50.0)  # 150 ms seen, 100 ms at the replicas
    assert row.requests_per_replica == [10, 30]
    assert row.replica_ttft_p50_s == 0.1  # 15 of 40 first tokens within 50 ms, all within 100
    text = table([row])
    assert "| ours | 150.0 | 100.0 | 900.0 | 100.0 | 50 | 70.0% | 1.50 | 12.5 | 50.0 | 0 |" in text
    write_compare(tmp_path, [row], {"ours": [0.1, 0.2]}, {"title": "t"})
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][0]["router"] == "ours"
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "![comparison](compare.png)" in (tmp_path / "compare.md").read_text()
