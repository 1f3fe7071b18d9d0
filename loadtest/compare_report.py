"""The comparison's one table and one chart: a row per router, from its load test's report and
the replicas' own counters (Prometheus text from each replica server's ``/metrics``)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')
TTFT_BUCKET = "prefixmesh_replica_ttft_seconds_bucket"
BUCKET_KEY = "ttft_le:"
"""Keys ``ttft_le:<bound>``: first tokens at or under the bound (a cumulative histogram)."""
COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "prefixmesh_replica_requests_total",
    "busy_s": "prefixmesh_replica_engine_busy_seconds_total",
    "ttft_sum_s": "prefixmesh_replica_ttft_seconds_sum",
    "ttft_count": "prefixmesh_replica_ttft_seconds_count",
    "cached_blocks": "prefixmesh_replica_cached_blocks",
    "in_flight": "prefixmesh_replica_in_flight",
}


def parse_counters(text: str) -> dict[str, float]:
    """The replica server's counters of interest (``COUNTERS`` keys), summed over labels."""
    names = {v: k for k, v in COUNTERS.items()}
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        key = names.get(match.group(1))
        if key is None and match.group(1) == TTFT_BUCKET:
            bound = _LE.search(match.group(2) or "")
            key = BUCKET_KEY + bound.group(1) if bound else None
        if key is not None:
            found[key] = found.get(key, 0.0) + float(match.group(3))
    return found


def delta(
    before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]
) -> list[dict[str, float]]:
    pairs = zip(before, after, strict=True)
    return [
        {k: a.get(k, 0.0) - b.get(k, 0.0) for k in COUNTERS.keys() | a.keys()} for b, a in pairs
    ]


def replica_ttft_p50(replica_deltas: Sequence[Mapping[str, float]]) -> float | None:
    """Median TTFT the replicas measured (arrival at the replica to its first token), read off
    their histograms as the upper bound of the median's bucket (10% wide); None without
    buckets. Set against the client's median it splits a gap into path and placement."""
    counts: dict[float, float] = {}
    for d in replica_deltas:
        for key, value in d.items():
            if key.startswith(BUCKET_KEY):
                bound = float(key.removeprefix(BUCKET_KEY))
                counts[bound] = counts.get(bound, 0.0) + value
    total = sum(d.get("ttft_count", 0.0) for d in replica_deltas)
    if not counts or total <= 0:
        return None
    for bound in sorted(counts):
        if counts[bound] >= total / 2:
            return bound
    return None


@dataclass(frozen=True)
class RouterRow:
    router: str
    setup: str
    requests: int
    failures: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    throughput_tok_s: float | None
    hit_rate: float
    """Replicas' own counters: prompt tokens served from cache / prompt tokens queried."""
    load_imbalance: float
    """Max / mean over replicas of engine busy time (sim), else of requests served."""
    overhead_idle_ms: float | None
    """Median TTFT of a 1-token request through the router minus straight to a replica."""
    overhead_loaded_ms: float | None
    """Mean TTFT the client saw minus the mean TTFT the replicas measured, during the run."""
    replica_ttft_p50_s: float | None
    """Median TTFT the replicas measured (``replica_ttft_p50``): the client's median less the
    path's cost."""
    requests_per_replica: list[int]
    arrival_cv: float | None
    load_avg: tuple[float, float]
    """The machine's 1-minute load average when the run started and ended."""


def make_row(
    router: str,
    setup: str,
    report: Mapping[str, Any],
    replica_deltas: Sequence[Mapping[str, float]],
    overhead_idle_ms: float | None,
    load_avg: tuple[float, float],
) -> RouterRow:
    queries = sum(d["queries"] for d in replica_deltas)
    hits = sum(d["hits"] for d in replica_deltas)
    busy = [d["busy_s"] for d in replica_deltas]
    served = [d["requests"] for d in replica_deltas]
    spread = busy if any(busy) else served
    mean = sum(spread) / len(spread) if spread else 0.0
    ttft_count = sum(d["ttft_count"] for d in replica_deltas)
    replica_ttft = sum(d["ttft_sum_s"] for d in replica_deltas) / ttft_count if ttft_count else None
    client_ttft = report.get("ttft_mean_s")
    loaded = None
    if client_ttft is not None and replica_ttft is not None:
        loaded = (client_ttft - replica_ttft) * 1000
    return RouterRow(
        router=router,
        setup=setup,
        requests=int(report.get("requests", 0)),
        failures=int(report.get("failures", 0)),
        ttft_mean_s=client_ttft,
        ttft_p50_s=report.get("ttft_p50_s"),
        ttft_p99_s=report.get("ttft_p99_s"),
        throughput_tok_s=report.get("throughput_tok_s"),
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        load_imbalance=round(max(spread) / mean, 3) if mean > 0 else 1.0,
        overhead_idle_ms=None if overhead_idle_ms is None else round(overhead_idle_ms, 2),
        overhead_loaded_ms=None if loaded is None else round(loaded, 2),
        replica_ttft_p50_s=replica_ttft_p50(replica_deltas),
        requests_per_replica=[int(s) for s in served],
        arrival_cv=report.get("arrival_cv"),
        load_avg=load_avg,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def table(rows: Sequence[RouterRow]) -> str:
    lines = [
        "| router | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | replica TTFT p50 ms | output tok/s "
        "| hit rate | load imbalance | overhead idle ms | overhead loaded ms | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        idle = "-" if r.overhead_idle_ms is None else f"{r.overhead_idle_ms:.1f}"
        loaded = "-" if r.overhead_loaded_ms is None else f"{r.overhead_loaded_ms:.1f}"
        lines.append(
            f"| {r.router} | {_ms(r.ttft_mean_s)} | {_ms(r.ttft_p50_s)} | {_ms(r.ttft_p99_s)} | "
            f"{_ms(r.replica_ttft_p50_s)} | {r.throughput_tok_s or 0:.0f} | {r.hit_rate:.1%} | "
            f"{r.load_imbalance:.2f} | "
            f"{idle} | {loaded} | {r.failures} |"
        )
    return "\n".join(lines)


def write_compare(
    folder: Path,
    rows: Sequence[RouterRow],
    ttfts: Mapping[str, Sequence[float]],
    meta: Mapping[str, Any],
) -> None:
    """``compare.json``, ``compare.md`` and ``compare.png``."""
    data = {"rows": [asdict(r) for r in rows], "meta": dict(meta)}
    (folder / "compare.json").write_text(json.dumps(data, indent=2) + "\n")
    plot_compare(rows, ttfts, folder / "compare.png", str(meta.get("title", "")))
    lines = [
        f"# Router comparison: {meta.get('title', '')}",
        "",
        table(rows),
        "",
        "![comparison](compare.png)",
        "",
        "Setups:",
        "",
    ]
    lines += [f"- **{r.router}**: {r.setup}" for r in rows]
    lines += ["", "Requests per replica:", ""]
    lines += [f"- {r.router}: {r.requests_per_replica}" for r in rows]
    lines += ["", "Settings:", "", "```json", json.dumps(dict(meta), indent=2), "```", ""]
    (folder / "compare.md").write_text("\n".join(lines))


def plot_compare(
    rows: Sequence[RouterRow], ttfts: Mapping[str, Sequence[float]], path: Path, title: str
) -> None:
    from prefixmesh.loadtest.report import _pyplot, plot_ttft_cdf

    plt = _pyplot()
    fig, (cdf, bars, hits) = plt.subplots(1, 3, figsize=(16, 5))
    plot_ttft_cdf(ttfts, path, "TTFT CDF", ax=cdf)
    names = [r.router for r in rows]
    xs = list(range(len(rows)))
    means = [r.ttft_mean_s or 0.0 for r in rows]
    p99s = [r.ttft_p99_s or 0.0 for r in rows]
    bars.bar([x - 0.2 for x in xs], means, width=0.4, label="mean")
    bars.bar([x + 0.2 for x in xs], p99s, width=0.4, label="p99")
    bars.set_xticks(xs, names, rotation=25, ha="right")
    bars.set_ylabel("TTFT (s)")
    bars.set_title("TTFT mean and p99")
    bars.grid(True, axis="y", alpha=0.3)
    bars.legend(fontsize="small")
    hits.bar(xs, [r.hit_rate for r in rows], color="tab:green")
    hits.set_xticks(xs, names, rotation=25, ha="right")
    hits.set_ylim(0, 1)
    hits.set_ylabel("prefix-cache hit rate (replica counters)")
    twin = hits.twinx()
    twin.plot(xs, [r.load_imbalance for r in rows], "o-", color="tab:red", label="imbalance")
    twin.set_ylabel("load imbalance (max/mean busy)")
    twin.legend(loc="upper right", fontsize="small")
    hits.set_title("hit rate and load imbalance")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
