"""serving-bench's split of TTFTs into hits and misses (by the usage's cached tokens), and
what it reads from the replicas' reports."""

from __future__ import annotations

from prefixmesh.loadtest.bench.serving import (
    Outcome,
    counters_of,
    prefill_rates_of,
    split_by_hit,
)


def test_split_by_hit_sorts_answered_requests_by_the_share_their_usage_says_was_cached() -> None:
    outcomes = [
        Outcome(0.05, 0.1, prompt_tokens=1564, cached_tokens=1408, replica="a"),
        Outcome(0.09, 0.2, prompt_tokens=1564, cached_tokens=782, replica="a"),  # exactly half
        Outcome(0.15, 0.3, prompt_tokens=1564, cached_tokens=781, replica="b"),
        Outcome(0.20, 0.3, prompt_tokens=1564, cached_tokens=0, replica="b"),
        Outcome(None, 0.3, prompt_tokens=1564, cached_tokens=1408, replica="", error="boom"),
    ]
    hits, misses = split_by_hit(outcomes)
    assert hits == [0.05, 0.09]
    assert misses == [0.15, 0.20]


def test_the_replicas_reports_give_counters_and_prefill_rates() -> None:
    stats = [
        {
            "replica_id": "b",
            "prefix_cache_queries_tokens": 3000,
            "prefix_cache_hit_tokens": 1408,
            "capacity": {"prefill_tokens_per_s": 14210.46, "decode_step_s": 0.01},
        },
        {"replica_id": "a", "prefix_cache_queries_tokens": 10, "prefix_cache_hit_tokens": 0},
    ]
    assert counters_of(stats) == {"b": (3000, 1408, 0, 0, 0), "a": (10, 0, 0, 0, 0)}
    assert prefill_rates_of(stats) == {"b": 14210.5}  # "a" reported no capacity
