"""``prefixmesh stream-bench``: do streams stream? Client-side gaps next to the engine's own.

It sends N streamed completions of T tokens (``ignore_eos``, so every stream is T tokens long)
to a running cluster or one replica, records when each server-sent event arrives, and reports
the gaps between consecutive content events (p50, p99, max, and how many exceed a stall
threshold) next to what the engine itself measured over the same run: the interval between a
request's consecutive output tokens inside the engine (``prefixmesh_engine_token_interval_seconds``,
read from the replicas' metrics before and after), and the replicas' GC pauses and event-loop
lag. A client gap far above the engine's interval is the serving path's; an engine interval as
long as the gap is the engine's.

Targets (issue 14): max gap <= 150 ms and p99 gap <= 3x the engine's median interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from prefixmesh.cli_help import command_parser
from prefixmesh.loadtest.sse import StreamResult, read_stream

ENGINE_INTERVAL = "prefixmesh_engine_token_interval_seconds"
GC_PAUSE = "prefixmesh_gc_pause_seconds"
LOOP_LAG = "prefixmesh_event_loop_lag_seconds"
TTFT = "prefixmesh_ttft_seconds"
RAY_PREFIX = "ray_"  # the same metrics through Ray's metrics agent

MAX_GAP_TARGET_S = 0.150
P99_OVER_ENGINE_MEDIAN_TARGET = 3.0


# ---- pure: statistics --------------------------------------------------------------------


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values (0 when there are none)."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values))))
    return sorted_values[index]


@dataclass(frozen=True)
class GapSummary:
    streams: int
    failed: int
    events: int
    ttft_p50_s: float
    gap_p50_s: float
    gap_p99_s: float
    gap_max_s: float
    stalls: int
    """Gaps longer than the stall threshold."""
    streams_with_stall: int
    decode_tokens_per_s: float = 0.0
    """Completion tokens over the streams' whole time (``decode_rate``): the throughput a
    client saw."""


def summarize_gaps(results: Sequence[StreamResult], stall_s: float) -> GapSummary:
    ok = [r for r in results if r.ok]
    gaps = sorted(g for r in ok for g in r.itl_s)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return GapSummary(
        streams=len(results),
        failed=len(results) - len(ok),
        events=sum(len(r.event_times_s) for r in ok),
        ttft_p50_s=quantile(ttfts, 0.5),
        gap_p50_s=quantile(gaps, 0.5),
        gap_p99_s=quantile(gaps, 0.99),
        gap_max_s=gaps[-1] if gaps else 0.0,
        stalls=sum(g > stall_s for g in gaps),
        streams_with_stall=sum(any(g > stall_s for g in r.itl_s) for r in ok),
        decode_tokens_per_s=decode_rate(ok),
    )


def decode_rate(results: Sequence[StreamResult]) -> float:
    """Completion tokens per second of the streams' whole time (one after another at
    concurrency 1, a short TTFT included): bursts move tokens in time, not this."""
    tokens = sum(r.completion_tokens for r in results)
    seconds = sum(r.e2e_s for r in results)
    return tokens / seconds if seconds > 0 else 0.0


Buckets = dict[float, float]
"""A histogram's cumulative bucket counts by upper bound (``le``), inf included."""


def histogram_buckets(text: str, name: str, **labels: str) -> Buckets:
    """Sum over every series (replica, process) of histogram ``name`` (or its Ray-exported
    ``ray_`` twin) in Prometheus text, of those with ``labels`` if given."""
    from prometheus_client.parser import text_string_to_metric_families

    total: Buckets = {}
    wanted = {name, RAY_PREFIX + name}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            matches = all(sample.labels.get(k) == v for k, v in labels.items())
            if sample.name.endswith("_bucket") and matches:
                bound = float(sample.labels["le"])
                total[bound] = total.get(bound, 0.0) + sample.value
    return total


def bucket_delta(before: Buckets, after: Buckets) -> Buckets:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def bucket_quantile(buckets: Buckets, q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket holding the q-th value;
    None without observations; the last finite bound when it falls in the +Inf bucket."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / max(count - lower_count, 1e-12)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_count(buckets: Buckets) -> int:
    return int(max(buckets.values(), default=0.0))


def count_above(buckets: Buckets, bound_s: float) -> int:
    """Observations above the smallest bucket bound >= ``bound_s`` (a lower bound on the count
    above ``bound_s`` itself)."""
    bounds = sorted(b for b in buckets if b >= bound_s)
    if not bounds:
        return 0
    return int(bucket_count(buckets) - buckets[bounds[0]])


def _max_bucket(buckets: Buckets) -> float | None:
    """The lower bound of the bucket holding the largest observation (None: no observations)."""
    total = bucket_count(buckets)
    if total <= 0:
        return None
    lower = 0.0
    for bound in sorted(buckets):
        if buckets[bound] >= total:
            return lower
        lower = bound
    return lower


@dataclass(frozen=True)
class ServerSide:
    """What the replicas measured over the run (None where no replica exported it)."""

    engine_intervals: int
    engine_interval_p50_s: float | None
    engine_interval_p99_s: float | None
    engine_interval_max_s: float | None
    """The lower bound of the bucket holding the longest interval."""
    gc_pauses_over_50ms: int
    loop_lag_running_over_50ms: int
    """Late wake-ups while the replica process ran (blocking code, GC)."""
    loop_lag_off_cpu_over_50ms: int
    """Late wake-ups while it was not scheduled (other processes had the cores)."""
    ttft_p50_s: float | None = None
    """The replicas' own TTFT histogram (from when the request entered the cluster), to set
    against the client's."""


def server_side(before: str, after: str) -> ServerSide:
    def delta(name: str, **labels: str) -> Buckets:
        return bucket_delta(
            histogram_buckets(before, name, **labels), histogram_buckets(after, name, **labels)
        )

    engine, gc, ttft = delta(ENGINE_INTERVAL), delta(GC_PAUSE), delta(TTFT)
    return ServerSide(
        engine_intervals=bucket_count(engine),
        engine_interval_p50_s=bucket_quantile(engine, 0.5),
        engine_interval_p99_s=bucket_quantile(engine, 0.99),
        engine_interval_max_s=_max_bucket(engine),
        gc_pauses_over_50ms=count_above(gc, 0.05),
        loop_lag_running_over_50ms=count_above(delta(LOOP_LAG, cause="running"), 0.05),
        loop_lag_off_cpu_over_50ms=count_above(delta(LOOP_LAG, cause="off_cpu"), 0.05),
        ttft_p50_s=bucket_quantile(ttft, 0.5),
    )


@dataclass(frozen=True)
class Verdict:
    max_gap_ok: bool
    p99_ok: bool | None
    """None when no engine interval was exported to compare with."""


def verdict(gaps: GapSummary, server: ServerSide) -> Verdict:
    median = server.engine_interval_p50_s
    return Verdict(
        max_gap_ok=gaps.failed == 0 and gaps.gap_max_s <= MAX_GAP_TARGET_S,
        p99_ok=None if not median else gaps.gap_p99_s <= P99_OVER_ENGINE_MEDIAN_TARGET * median,
    )


# ---- adapters: HTTP ----------------------------------------------------------------------


def _body(model: str, index: int, tokens: int, chat: bool) -> dict[str, object]:
    # Distinct prompts: each stream computes its own prefill, as independent users would.
    text = f"stream {index}: tell me everything about the number {index * 7919}."
    body: dict[str, object] = {
        "model": model,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def run_stream(target: str, body: dict[str, object], chat: bool, timeout_s: float) -> StreamResult:
    import httpx

    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        # The clock starts after the client exists: making one loads TLS roots (~20 ms here).
        with httpx.Client(timeout=timeout_s) as client:
            started = time.perf_counter()
            return _read(client.stream("POST", target + path, json=body), started)
    except httpx.HTTPError as exc:
        return StreamResult(error=f"{type(exc).__name__}: {exc}"[:300])


def _read(request: Any, started: float) -> StreamResult:
    with request as response:
        if response.status_code != 200:
            response.read()
            return StreamResult(status=response.status_code, error=response.text[:300])
        lines: Iterator[str] = iter(response.iter_lines())

        def readline() -> bytes:
            line = next(lines, None)
            return b"" if line is None else (line + "\n").encode()

        return read_stream(readline, started, time.perf_counter)


def scrape(urls: Sequence[str], timeout_s: float = 10.0) -> str:
    """Every metrics page, concatenated (unreachable ones left out, with a note on stderr)."""
    import httpx

    pages = []
    for url in urls:
        try:
            response = httpx.get(url, timeout=timeout_s)
            response.raise_for_status()
            pages.append(response.text)
        except httpx.HTTPError as exc:
            print(f"stream-bench: no metrics from {url}: {exc}", file=sys.stderr)
    return "\n".join(pages)


def served_model(target: str) -> str:
    import httpx

    models = httpx.get(target + "/v1/models", timeout=10.0).json()["data"]
    return str(models[0]["id"])


def parse_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--target", default="http://127.0.0.1:8000", help="base URL of the OpenAI API"
    )
    parser.add_argument("--streams", type=int, default=10, help="streamed completions to send")
    parser.add_argument(
        "--tokens", type=int, default=400, help="output tokens per stream, eos ignored"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="streams in flight at once")
    parser.add_argument(
        "--chat", action="store_true", help="chat completions instead of text completions"
    )
    parser.add_argument("--model", help="model name (default: none, the first the target lists)")
    parser.add_argument(
        "--metrics-url",
        action="append",
        help="replica metrics to read the engine's intervals from, repeatable (default: none, "
        "the target's /metrics; on a cluster, Ray's metrics agent endpoint covers every replica)",
    )
    parser.add_argument(
        "--stall-ms", type=float, default=100.0, help="a gap this long is a stall, in ms"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="each stream's time limit, in s"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.5,
        help="wait this long before the second scrape, in s (Ray's metrics agent: 12, it "
        "exports every 10 s)",
    )
    parser.add_argument("--json", help="write the report here, JSON (default: none)")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str], prog: str = "stream-bench") -> int:
    args = parse_args(argv, prog)
    target = args.target.rstrip("/")
    metrics_urls = args.metrics_url or [target + "/metrics"]
    model = args.model or served_model(target)
    before = scrape(metrics_urls)
    bodies = [_body(model, i, args.tokens, args.chat) for i in range(args.streams)]
    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        results = list(
            pool.map(lambda body: run_stream(target, body, args.chat, args.timeout_s), bodies)
        )
    # The engine reports its intervals with its outputs, a replica moves them into metrics every
    # second, and Ray's agent exports every 10 s: the second scrape waits for the last ones.
    time.sleep(args.settle_s)
    after = scrape(metrics_urls)
    gaps = summarize_gaps(results, args.stall_ms / 1e3)
    server = server_side(before, after)
    judged = verdict(gaps, server)
    report = {
        "target": target,
        "streams": args.streams,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "chat": args.chat,
        "client": asdict(gaps),
        "server": asdict(server),
        "verdict": asdict(judged),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    print(render(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if gaps.failed == 0 else 1


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def render(report: dict[str, object]) -> str:
    client = report["client"]
    server = report["server"]
    judged = report["verdict"]
    assert isinstance(client, dict) and isinstance(server, dict) and isinstance(judged, dict)
    lines = [
        f"{report['streams']} streams x {report['tokens']} tokens, {report['concurrency']} at "
        f"once, to {report['target']} ({client['failed']} failed)",
        f"client gaps: p50 {_ms(client['gap_p50_s'])}, p99 {_ms(client['gap_p99_s'])}, max "
        f"{_ms(client['gap_max_s'])}; {client['stalls']} stalls in "
        f"{client['streams_with_stall']} streams; TTFT p50 {_ms(client['ttft_p50_s'])} (the "
        f"replicas' own histogram: {_ms(server['ttft_p50_s'])}); decode "
        f"{client['decode_tokens_per_s']:.0f} tokens/s",
        f"engine token interval: p50 {_ms(server['engine_interval_p50_s'])}, p99 "
        f"{_ms(server['engine_interval_p99_s'])}, max > {_ms(server['engine_interval_max_s'])} "
        f"({server['engine_intervals']} intervals)",
        f"replicas: {server['gc_pauses_over_50ms']} GC pauses > 50 ms; event-loop lags > 50 ms: "
        f"{server['loop_lag_running_over_50ms']} while running, "
        f"{server['loop_lag_off_cpu_over_50ms']} while not scheduled",
        f"targets: max gap <= 150 ms {'met' if judged['max_gap_ok'] else 'NOT met'}; p99 <= 3x "
        "engine median "
        + {True: "met", False: "NOT met", None: "unknown (no engine intervals)"}[judged["p99_ok"]],
    ]
    lines += [f"error: {error}" for error in report.get("errors") or ()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
