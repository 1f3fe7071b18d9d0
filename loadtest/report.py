"""A load test's results: per-request records, the summary, ``report.json``, ``report.md`` and
PNG charts (TTFT CDF; throughput and TTFT over time), with matplotlib's Agg backend.

``report.json`` always has ``requests``, ``failures``, ``ttft_p50_s``, ``ttft_p90_s``,
``ttft_p99_s``, ``itl_p50_s``, ``throughput_tok_s``, ``hit_rate`` and ``arrival_cv`` (the
coefficient of variation of the measured gaps between request launches: 1.0 for Poisson), then
details. ``hit_rate`` comes from the replicas' own prefix-cache counters when their ``/metrics``
were given (``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, summed), else from
the responses' ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixmesh.loadtest.poisson import arrival_cv, percentile
from prefixmesh.loadtest.sse import StreamResult
from prefixmesh.loadtest.workloads import WorkloadRequest

REQUIRED_KEYS = (
    "requests",
    "failures",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "itl_p50_s",
    "throughput_tok_s",
    "hit_rate",
    "arrival_cv",
)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class ClientRecord:
    """One request as the client saw it; times in seconds from the start of the run."""

    id: str
    kind: str
    scheduled_s: float
    sent_s: float
    end_s: float
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: int
    error: str
    replica: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None

    @classmethod
    def from_result(
        cls,
        request: WorkloadRequest,
        result: StreamResult,
        scheduled_s: float,
        sent_s: float,
        end_s: float,
        replica: str,
    ) -> ClientRecord:
        return cls(
            request.request_id,
            request.kind,
            scheduled_s,
            sent_s,
            end_s,
            result.ttft_s,
            result.e2e_s,
            result.itl_s,
            result.prompt_tokens,
            result.cached_tokens,
            result.completion_tokens,
            result.status,
            result.error,
            replica,
        )

    @classmethod
    def dropped(cls, request: WorkloadRequest, scheduled_s: float) -> ClientRecord:
        error = "not sent: too many requests in flight"
        return cls(
            request.request_id, request.kind, scheduled_s, scheduled_s, scheduled_s, None, 0.0,
            [], 0, 0, 0, 0, error,
        )  # fmt: skip


@dataclass
class LiveSummary:
    """Running numbers for the web UI's /prefixmesh page."""

    planned: int = 0
    done: int = 0
    failed: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)

    def reset(self, planned: int) -> None:
        self.__init__()  # type: ignore[misc]
        self.planned = planned

    def add(self, record: ClientRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.completion_tokens += record.completion_tokens
        if record.ttft_s is not None:
            self.ttfts.append(record.ttft_s)

    def snapshot(self) -> dict[str, Any]:
        recent = self.ttfts[-2000:]
        return {
            "planned_requests": self.planned,
            "finished_requests": self.done,
            "failed_requests": self.failed,
            "dropped_requests": self.dropped,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0,
            "ttft_p50_s_last_2000": percentile(recent, 0.5) if recent else None,
            "ttft_p99_s_last_2000": percentile(recent, 0.99) if recent else None,
        }


def prefix_cache_counters(metrics_text: str) -> tuple[float, float]:
    """(queries, hits) in prompt tokens from a Prometheus page with vLLM's counter names,
    summed over label sets."""
    queries = hits = 0.0
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, value = match.group(1), float(match.group(3))
        if name == "vllm:prefix_cache_queries_total":
            queries += value
        elif name == "vllm:prefix_cache_hits_total":
            hits += value
    return queries, hits


def _round(value: float | None, digits: int = 5) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(value, digits)


def summarize(
    records: Sequence[ClientRecord],
    launches: Sequence[tuple[float, float]],
    counters_before: Mapping[str, tuple[float, float]] | None = None,
    counters_after: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """The report's numbers. ``launches`` are the scheduler's (scheduled, launched) times of
    the requests that arrive on schedule; follow-up turns arrive after their predecessor."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    sent = [r.sent_s for r in records if r.status or r.error]
    first = min((r.sent_s for r in records), default=0.0)
    last = max((r.end_s for r in records), default=0.0)
    span = last - first
    usage_hit = cached / prompt if prompt else 0.0
    replica_hit = None
    if counters_before is not None and counters_after is not None:
        queries = sum(after[0] - counters_before.get(url, (0.0, 0.0))[0]
                      for url, after in counters_after.items())  # fmt: skip
        hits = sum(after[1] - counters_before.get(url, (0.0, 0.0))[1]
                   for url, after in counters_after.items())  # fmt: skip
        replica_hit = hits / queries if queries > 0 else 0.0
    launch_drift = [launched - scheduled for scheduled, launched in launches]
    send_drift = [r.sent_s - r.scheduled_s for r in records if r.status or r.error]
    scheduled = [s for s, _ in launches]
    offered = (len(scheduled) - 1) / (scheduled[-1] - scheduled[0]) if len(scheduled) > 2 else 0.0
    summary: dict[str, Any] = {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "ttft_p50_s": _round(percentile(ttfts, 0.50)),
        "ttft_p90_s": _round(percentile(ttfts, 0.90)),
        "ttft_p99_s": _round(percentile(ttfts, 0.99)),
        "itl_p50_s": _round(percentile(itls, 0.50)),
        "throughput_tok_s": _round(output / span if span > 0 else 0.0, 2),
        "hit_rate": _round(replica_hit if replica_hit is not None else usage_hit, 4),
        "arrival_cv": _round(arrival_cv([launched for _, launched in launches]), 4),
        # details
        "hit_rate_source": "replica counters" if replica_hit is not None else "usage",
        "usage_hit_rate": _round(usage_hit, 4),
        "ttft_mean_s": _round(sum(ttfts) / len(ttfts) if ttfts else math.nan),
        "itl_p99_s": _round(percentile(itls, 0.99)),
        "e2e_p50_s": _round(percentile([r.e2e_s for r in ok], 0.50)),
        "e2e_p99_s": _round(percentile([r.e2e_s for r in ok], 0.99)),
        "offered_rate_per_s": _round(offered, 3),
        "achieved_rate_per_s": _round((len(sent) - 1) / span if span > 0 else 0.0, 3),
        "arrival_cv_scheduled": _round(arrival_cv(scheduled), 4),
        "launch_drift_p50_ms": _round(percentile(launch_drift, 0.5) * 1000, 3),
        "launch_drift_p99_ms": _round(percentile(launch_drift, 0.99) * 1000, 3),
        "launch_drift_max_ms": _round(max(launch_drift, default=math.nan) * 1000, 3),
        "send_drift_p99_ms": _round(percentile(send_drift, 0.99) * 1000, 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": output,
        "duration_s": _round(span, 3),
        "errors": _error_counts(records),
    }
    return summary


def _error_counts(records: Sequence[ClientRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        if not record.ok:
            key = record.error[:80] or f"HTTP {record.status}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:10])


def write_report(
    folder: Path,
    records: Sequence[ClientRecord],
    launches: Sequence[tuple[float, float]],
    meta: Mapping[str, Any],
    counters_before: Mapping[str, tuple[float, float]] | None = None,
    counters_after: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """``records.jsonl``, ``report.json``, ``report.md``, ``ttft_cdf.png``, ``timeline.png``."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, launches, counters_before, counters_after)
    with (folder / "records.jsonl").open("w") as out:
        for record in records:
            out.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
    report = {**summary, "meta": dict(meta)}
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    title = str(meta.get("title") or _title(meta))
    plot_ttft_cdf({title: [r.ttft_s for r in records if r.ok and r.ttft_s is not None]},
                  folder / "ttft_cdf.png", "TTFT CDF")  # fmt: skip
    plot_timeline(records, folder / "timeline.png", title)
    (folder / "report.md").write_text(markdown(summary, meta, title))
    return report


def _title(meta: Mapping[str, Any]) -> str:
    plan = meta.get("plan") or {}
    source = plan.get("workload") or Path(str(plan.get("trace") or "trace")).name
    rate = plan.get("rate")
    return f"{source} at {rate} req/s" if rate else str(source)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown(summary: Mapping[str, Any], meta: Mapping[str, Any], title: str) -> str:
    lines = [f"# Load test: {title}", "", f"Target: `{meta.get('target', '')}`", ""]
    lines += ["| metric | value |", "|---|---:|"]
    for key, value in summary.items():
        if key != "errors":
            lines.append(f"| {key} | {_fmt(value)} |")
    if summary.get("errors"):
        lines += ["", "Errors:", ""]
        lines += [f"- {count} x `{text}`" for text, count in summary["errors"].items()]
    lines += ["", "![TTFT CDF](ttft_cdf.png)", "", "![over time](timeline.png)", ""]
    lines += ["Settings:", "", "```json", json.dumps(dict(meta), indent=2), "```", ""]
    return "\n".join(lines)


# ---- charts --------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(
    ttfts: Mapping[str, Sequence[float]], path: Path, title: str, ax: Any = None
) -> None:
    """One CDF line per run (log-scale TTFT)."""
    plt = _pyplot()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in ttfts.items():
        ordered = sorted(values)
        if ordered:
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.plot(ordered, ys, label=f"{name} (n={len(ordered)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    if own:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot_timeline(records: Sequence[ClientRecord], path: Path, title: str) -> None:
    """Output tokens/s and requests/s per second of the run; TTFT of each request at its send
    time with a rolling p50 and p99."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_s)
    if ok:
        seconds = int(max(r.end_s for r in ok)) + 1
        tokens = [0.0] * seconds
        sends = [0] * seconds
        for r in ok:
            sends[min(seconds - 1, int(r.sent_s))] += 1
            # spread a request's output over its decode time
            start, end = r.sent_s + (r.ttft_s or 0.0), r.end_s
            length = max(end - start, 1e-6)
            for second in range(int(start), min(seconds, int(end) + 1)):
                overlap = min(end, second + 1) - max(start, second)
                if overlap > 0:
                    tokens[second] += r.completion_tokens * overlap / length
        xs = list(range(seconds))
        top.plot(xs, tokens, label="output tokens/s")
        twin = top.twinx()
        twin.plot(xs, sends, color="tab:orange", alpha=0.6, label="requests sent/s")
        twin.set_ylabel("requests/s")
        top.set_ylabel("tokens/s")
        top.legend(loc="upper left", fontsize="small")
        twin.legend(loc="upper right", fontsize="small")
        times = [r.sent_s for r in ok]
        values = [r.ttft_s or 0.0 for r in ok]
        bottom.scatter(times, values, s=4, alpha=0.4, label="TTFT")
        window = max(20, len(ok) // 30)
        p50 = [percentile(values[max(0, i - window) : i + 1], 0.5) for i in range(len(values))]
        p99 = [percentile(values[max(0, i - window) : i + 1], 0.99) for i in range(len(values))]
        bottom.plot(times, p50, color="tab:green", label=f"rolling p50 ({window})")
        bottom.plot(times, p99, color="tab:red", label=f"rolling p99 ({window})")
        bottom.set_yscale("log")
        bottom.legend(fontsize="small")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylabel("TTFT (s)")
    top.set_title(title)
    top.grid(True, alpha=0.3)
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
