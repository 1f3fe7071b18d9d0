"""The numbers a policy run is judged by.

- hit_rate: prompt tokens served from cache (either tier) / prompt tokens;
- oracle_hit_rate: the same for one unbounded cache in arrival order (the ceiling);
- ttft_mean_s / ttft_p50_s / ttft_p99_s: arrival at the router to first token;
- throughput_tok_s: output tokens / makespan (first arrival to last finish);
- load_imbalance: max / mean of the replicas' busy time (1.0 = perfectly even);
- redundant_prefill_tokens: prompt tokens computed minus those the oracle computes (work that a
  perfect router with unbounded caches would not have done);
- requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prefixmesh.loadtest.cluster_sim import SimResult
from prefixmesh.loadtest.oracle import OracleResult

SUMMARY_KEYS = (
    "hit_rate",
    "oracle_hit_rate",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_tok_s",
    "load_imbalance",
    "redundant_prefill_tokens",
    "requests",
)


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    hit_rate: float
    oracle_hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    load_imbalance: float
    redundant_prefill_tokens: int
    requests: int
    # details
    ttft_p90_s: float
    prefill_tokens: int
    cached_tokens: int
    cpu_cached_tokens: int
    shared_cached_tokens: int
    held_requests: int
    held_mean_s: float
    """Mean hold time of the requests that were held."""
    makespan_s: float
    busy_max_s: float
    busy_mean_s: float

    def summary(self) -> dict[str, float | int]:
        """The headline numbers (the JSON report's per-policy object)."""
        values = asdict(self)
        return {key: values[key] for key in SUMMARY_KEYS}

    def details(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if k not in SUMMARY_KEYS}


def compute_metrics(result: SimResult, oracle: OracleResult) -> PolicyMetrics:
    records = [o.record for o in result.outcomes]
    if not records:
        raise ValueError("no requests")
    ttfts = np.array([r.ttft_s for r in records], dtype=float)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    prefill = sum(r.prefill_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    makespan = result.end_s - result.start_s
    held = [r.held_s for r, o in zip(records, result.outcomes, strict=True) if o.held]
    busy = np.array(result.busy_s, dtype=float)
    busy_mean = float(busy.mean())
    return PolicyMetrics(
        hit_rate=cached / prompt if prompt else 0.0,
        oracle_hit_rate=oracle.hit_rate,
        ttft_mean_s=float(ttfts.mean()),
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        throughput_tok_s=output / makespan if makespan > 0 else 0.0,
        load_imbalance=float(busy.max()) / busy_mean if busy_mean > 0 else 1.0,
        redundant_prefill_tokens=prefill - oracle.miss_tokens,
        requests=len(records),
        ttft_p90_s=float(np.percentile(ttfts, 90)),
        prefill_tokens=prefill,
        cached_tokens=cached,
        cpu_cached_tokens=sum(r.cpu_cached_tokens for r in records),
        shared_cached_tokens=sum(r.shared_cached_tokens for r in records),
        held_requests=len(held),
        held_mean_s=sum(held) / len(held) if held else 0.0,
        makespan_s=makespan,
        busy_max_s=float(busy.max()),
        busy_mean_s=busy_mean,
    )
