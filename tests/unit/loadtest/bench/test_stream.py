from __future__ import annotations

import pytest

from prefixmesh.loadtest.bench.stream import (
    bucket_delta,
    bucket_quantile,
    count_above,
    histogram_buckets,
    server_side,
    summarize_gaps,
    verdict,
)
from prefixmesh.loadtest.sse import StreamResult

INF = float("inf")


def _stream(times: list[float]) -> StreamResult:
    return StreamResult(status=200, ttft_s=times[0], event_times_s=times)


def test_gaps_are_between_consecutive_events_of_each_stream_not_across_streams() -> None:
    results = [_stream([0.1, 0.11, 0.12]), _stream([5.0, 5.01, 5.4])]
    summary = summarize_gaps(results, stall_s=0.1)
    assert summary.events == 6
    assert summary.gap_max_s == pytest.approx(0.39)
    assert summary.stalls == 1
    assert summary.streams_with_stall == 1
    assert summary.failed == 0


def test_failed_streams_are_counted_and_left_out_of_the_gaps() -> None:
    results = [_stream([0.1, 0.2]), StreamResult(status=503, error="busy")]
    summary = summarize_gaps(results, stall_s=0.05)
    assert summary.failed == 1
    assert summary.events == 2
    assert not verdict(summary, server_side("", "")).max_gap_ok


HISTOGRAM = """# HELP prefixmesh_engine_token_interval_seconds x
# TYPE prefixmesh_engine_token_interval_seconds histogram
prefixmesh_engine_token_interval_seconds_bucket{{le="0.001"}} {a}
prefixmesh_engine_token_interval_seconds_bucket{{le="0.002"}} {b}
prefixmesh_engine_token_interval_seconds_bucket{{le="+Inf"}} {c}
prefixmesh_engine_token_interval_seconds_count {c}
prefixmesh_engine_token_interval_seconds_sum 0.1
"""
RAY_HISTOGRAM = """# TYPE ray_prefixmesh_engine_token_interval_seconds histogram
ray_prefixmesh_engine_token_interval_seconds_bucket{{ReplicaId="r2",le="0.001"}} {a}
ray_prefixmesh_engine_token_interval_seconds_bucket{{ReplicaId="r2",le="0.002"}} {b}
ray_prefixmesh_engine_token_interval_seconds_bucket{{ReplicaId="r2",le="+Inf"}} {c}
ray_prefixmesh_engine_token_interval_seconds_count{{ReplicaId="r2"}} {c}
ray_prefixmesh_engine_token_interval_seconds_sum{{ReplicaId="r2"}} 0.1
"""


def test_buckets_sum_over_replicas_and_the_ray_exported_twin() -> None:
    text = HISTOGRAM.format(a=1, b=3, c=4) + RAY_HISTOGRAM.format(a=0, b=2, c=2)
    name = "prefixmesh_engine_token_interval_seconds"
    assert histogram_buckets(text, name) == {0.001: 1, 0.002: 5, INF: 6}


def test_the_run_is_the_delta_between_scrapes() -> None:
    before = HISTOGRAM.format(a=10, b=10, c=10)
    after = HISTOGRAM.format(a=10, b=30, c=30)
    server = server_side(before, after)
    assert server.engine_intervals == 20
    # Every new interval falls in (1 ms, 2 ms]: the median is interpolated inside it.
    assert server.engine_interval_p50_s == pytest.approx(0.0015)


def test_bucket_quantile_like_prometheus() -> None:
    buckets = {0.01: 50.0, 0.02: 100.0, INF: 100.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.01)
    assert bucket_quantile(buckets, 0.75) == pytest.approx(0.015)
    assert bucket_quantile({0.01: 0.0, INF: 0.0}, 0.5) is None
    # Past the last finite bound: that bound (what histogram_quantile answers).
    assert bucket_quantile({0.01: 1.0, INF: 4.0}, 0.9) == pytest.approx(0.01)


def test_count_above_a_bound() -> None:
    buckets = bucket_delta({0.05: 1.0, 0.1: 1.0, INF: 1.0}, {0.05: 4.0, 0.1: 6.0, INF: 9.0})
    assert count_above(buckets, 0.05) == 5
    assert count_above(buckets, 0.1) == 3
    assert count_above(buckets, 5.0) == 0


def test_p99_is_judged_against_the_engine_median() -> None:
    gaps = summarize_gaps([_stream([0.0, 0.004, 0.008, 0.05])], stall_s=0.1)
    server = server_side(HISTOGRAM.format(a=0, b=0, c=0), HISTOGRAM.format(a=0, b=10, c=10))
    judged = verdict(gaps, server)
    assert judged.max_gap_ok  # 42 ms
    assert judged.p99_ok is False  # 42 ms > 3 x 1.5 ms
    assert verdict(gaps, server_side("", "")).p99_ok is None


def test_the_longest_engine_interval_is_bounded_below_by_its_bucket() -> None:
    server = server_side(HISTOGRAM.format(a=0, b=0, c=0), HISTOGRAM.format(a=5, b=9, c=10))
    assert server.engine_interval_max_s == 0.002  # one interval past 2 ms
    server = server_side(HISTOGRAM.format(a=0, b=0, c=0), HISTOGRAM.format(a=5, b=9, c=9))
    assert server.engine_interval_max_s == 0.001
    assert server_side("", "").engine_interval_max_s is None


LAGS = """# TYPE prefixmesh_event_loop_lag_seconds histogram
prefixmesh_event_loop_lag_seconds_bucket{{cause="running",le="0.05"}} {r}
prefixmesh_event_loop_lag_seconds_bucket{{cause="running",le="+Inf"}} {rt}
prefixmesh_event_loop_lag_seconds_count{{cause="running"}} {rt}
prefixmesh_event_loop_lag_seconds_sum{{cause="running"}} 1
prefixmesh_event_loop_lag_seconds_bucket{{cause="off_cpu",le="0.05"}} {o}
prefixmesh_event_loop_lag_seconds_bucket{{cause="off_cpu",le="+Inf"}} {ot}
prefixmesh_event_loop_lag_seconds_count{{cause="off_cpu"}} {ot}
prefixmesh_event_loop_lag_seconds_sum{{cause="off_cpu"}} 1
"""


def test_loop_lags_are_told_apart_by_cause() -> None:
    server = server_side(LAGS.format(r=0, rt=0, o=0, ot=0), LAGS.format(r=10, rt=12, o=5, ot=8))
    assert server.loop_lag_running_over_50ms == 2
    assert server.loop_lag_off_cpu_over_50ms == 3


def test_decode_rate_is_tokens_over_the_streams_whole_time() -> None:
    """A burst moves tokens in time: the rate counts the streams' whole time, not the span
    between first and last event, which a late first event would shorten."""
    one = StreamResult(
        status=200, ttft_s=0.5, e2e_s=2.0, event_times_s=[1.9, 2.0], completion_tokens=10
    )
    two = StreamResult(
        status=200, ttft_s=0.2, e2e_s=1.0, event_times_s=[0.2, 1.0], completion_tokens=5
    )
    summary = summarize_gaps([one, two], stall_s=1.0)
    assert summary.decode_tokens_per_s == pytest.approx(15 / 3.0)
    assert summarize_gaps([], stall_s=1.0).decode_tokens_per_s == 0.0
