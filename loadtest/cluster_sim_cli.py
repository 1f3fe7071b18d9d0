"""``prefixmesh simulate``, the cluster simulator's CLI: routing policies compared on a simulated
fleet (``cluster_sim.py``; no GPU, no Ray).

Every policy sees the same requests at the same times on identical fresh replicas; the table
gives one row per policy plus the ceiling (oracle hit rate) and the TTFT floor. ``--load F``
sizes the arrival rate (or rescales a trace) so that the offered work is F of the fleet's
capacity, counting only what a perfect cache would still compute (``oracle.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefixmesh.cli_help import command_parser
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.loadtest.cli_args import add_config_args, add_source_args
from prefixmesh.loadtest.cluster_sim import ClusterSim, SimConfig
from prefixmesh.loadtest.keys import KeyBuilder
from prefixmesh.loadtest.metrics import PolicyMetrics, compute_metrics
from prefixmesh.loadtest.oracle import (
    OracleResult,
    fleet_capacity,
    offered_work_s,
    oracle_hits,
    ttft_floor_s,
    work_model,
)
from prefixmesh.loadtest.traces import load_trace, rescale
from prefixmesh.loadtest.workloads import WorkloadRequest, make_workload
from prefixmesh.replica.kvcache.policy import POLICY_NAMES as CACHE_POLICY_NAMES
from prefixmesh.replica.kvcache.policy import Clock, TierPolicy, make_tier_policy
from prefixmesh.replica.sim_model.profile import (
    DEFAULT_PROFILE,
    PROFILES,
    EngineProfile,
    get_profile,
    with_cpu_tier,
    with_shared_tier,
)
from prefixmesh.router.policy import POLICY_NAMES
from prefixmesh.router.policy.base import RoutingPolicy

ALL_POLICIES = POLICY_NAMES  # every policy the router can run
DEFAULT_LOAD = 0.7
DEFAULT_REQUESTS = 2000
DEFAULT_TRACE_REPLICAS = 16

PolicyFactory = Callable[..., RoutingPolicy]
"""``make_policy(name, config, *, rng, block_size)``."""


def parse_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    add_source_args(parser)
    _add_fleet_args(parser)
    _add_tier_args(parser)
    parser.add_argument(
        "--registry-lag-s",
        type=float,
        default=0.05,
        help="delay from a replica's cache change to the registry showing it, in s; 0: at once",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests and policies")
    add_config_args(parser, "its routing and registry sections", set_dest="set")
    parser.add_argument("--json", type=Path, help="write the results here (default: none)")
    parser.add_argument("--plot", type=Path, help="write TTFT charts here, PNG (default: none)")
    args = parser.parse_args(list(argv))
    for name in ("replicas", "rate", "load", "requests", "duration"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be > 0")
    if min(args.registry_lag_s, args.cpu_blocks, args.shared_blocks, args.lookahead or 0) < 0:
        parser.error("--registry-lag-s, --cpu-blocks, --shared-blocks and --lookahead must be >= 0")
    if args.shared_gb_per_s <= 0:
        parser.error("--shared-gb-per-s must be > 0")
    return args


def _add_fleet_args(parser: argparse.ArgumentParser) -> None:
    """The fleet, the arrivals and the policies."""
    parser.add_argument(
        "--replicas",
        type=int,
        help=f"fleet size (default: none, the workload's own, 8 for most, or "
        f"{DEFAULT_TRACE_REPLICAS} for a trace)",
    )
    parser.add_argument(
        "--tp-degrees",
        metavar="D1,D2,...",
        help="tensor-parallel degree per replica, comma-separated, or one value for all "
        "(default: none, 1 for every replica)",
    )
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument(
        "--rate",
        type=float,
        help="a workload's Poisson arrivals per second (a trace is rescaled with --load)",
    )
    rate.add_argument(
        "--load",
        type=float,
        help=f"offered work / fleet capacity, a fraction (default: none, {DEFAULT_LOAD} for a "
        "workload given no --rate; a trace plays at its own speed)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help=f"at most this many requests (default: none, {DEFAULT_REQUESTS} of a workload, a "
        "trace's every one)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        help="only arrivals before this time, in s (default: none, no limit)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(ALL_POLICIES),
        help=f"routing policies, comma-separated, of {', '.join(ALL_POLICIES)}",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help="the simulated engine's timing profile",
    )


def _add_tier_args(parser: argparse.ArgumentParser) -> None:
    """The lower cache tiers: each replica's CPU tier, the cluster's shared one."""
    parser.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        metavar="N",
        help="add a CPU tier of N blocks per replica; 0: none",
    )
    parser.add_argument(
        "--cpu-policy",
        choices=CACHE_POLICY_NAMES,
        help="the CPU tier's cache policy (default: none, the config's kvcache.policy)",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        metavar="N",
        help="tell the CPU tier's policy up to N requests waiting at its engine (Lookahead; "
        "default: none, the config's kvcache.lookahead_requests)",
    )
    parser.add_argument(
        "--shared-blocks",
        type=int,
        default=0,
        metavar="N",
        help="add a tier of N blocks the whole cluster shares (written by whichever replica "
        "computed a block, loaded by any); 0: none",
    )
    parser.add_argument(
        "--shared-gb-per-s",
        type=float,
        default=10.0,
        help="each replica's read bandwidth from the shared tier, in GB/s (10: a fast NVMe or "
        "RDMA store), which sets its load cost per block",
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    requests: list[WorkloadRequest]
    profile: EngineProfile
    tp_degrees: tuple[int, ...]
    oracle: OracleResult
    offered_load: float
    rate_per_s: float


def _tp_degrees(text: str | None, replicas: int) -> tuple[int, ...]:
    if not text:
        return (1,) * replicas
    values = tuple(int(v) for v in text.split(","))
    if len(values) == 1:
        return values * replicas
    if len(values) != replicas:
        raise SystemExit(f"--tp-degrees names {len(values)} replicas, the fleet has {replicas}")
    return values


def _params(items: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param wants FIELD=VALUE, got {item!r}")
        params[field] = yaml.safe_load(value)
    return params


def _offered_load(
    requests: Sequence[WorkloadRequest],
    oracle: OracleResult,
    profile: EngineProfile,
    capacity: float,
) -> float:
    """Offered work per second of the arrival span, as a fraction of fleet capacity."""
    if len(requests) < 2:
        return 0.0
    work = offered_work_s(requests, oracle, work_model(profile, requests))
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return work / span / capacity if span > 0 else float("inf")


def _scenario(
    name: str,
    requests: list[WorkloadRequest],
    profile: EngineProfile,
    tps: tuple[int, ...],
    oracle: OracleResult | None = None,
) -> Scenario:
    if oracle is None or len(oracle.hit_tokens) != len(requests):
        oracle = oracle_hits(requests, KeyBuilder(profile.block_size))
    capacity = fleet_capacity(profile, tps)
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    rate = (len(requests) - 1) / span if span > 0 else 0.0
    load = _offered_load(requests, oracle, profile, capacity)
    return Scenario(name, requests, profile, tps, oracle, load, rate)


def build_scenario(args: argparse.Namespace) -> Scenario:
    profile = get_profile(args.profile)
    if args.cpu_blocks:
        profile = with_cpu_tier(profile, args.cpu_blocks)
    if args.shared_blocks:
        profile = with_shared_tier(profile, args.shared_gb_per_s * 1e9)
    if args.trace is not None:
        if args.rate is not None:
            raise SystemExit("--rate applies to workloads; rescale a trace with --load")
        fmt = None if args.trace_format == "auto" else args.trace_format
        requests = load_trace(args.trace, fmt)
        if args.requests is not None:
            requests = requests[: args.requests]
        tps = _tp_degrees(args.tp_degrees, args.replicas or DEFAULT_TRACE_REPLICAS)
        oracle = oracle_hits(requests, KeyBuilder(profile.block_size))
        if args.load is not None:
            own = _offered_load(requests, oracle, profile, fleet_capacity(profile, tps))
            requests = rescale(requests, own / args.load)
        if args.duration is not None:
            requests = [r for r in requests if r.arrival_s < args.duration]
        return _scenario(args.trace.name, requests, profile, tps, oracle)
    workload = make_workload(args.workload, _params(args.param))
    tps = _tp_degrees(args.tp_degrees, args.replicas or workload.default_replicas)
    count = args.requests or DEFAULT_REQUESTS
    rate = args.rate
    if rate is None:
        # Shapes do not depend on the rate (separate random streams): size it on a probe.
        target = DEFAULT_LOAD if args.load is None else args.load
        probe = workload.generate(count, 1.0, args.seed)
        oracle = oracle_hits(probe, KeyBuilder(profile.block_size))
        mean_work = offered_work_s(probe, oracle, work_model(profile, probe)) / len(probe)
        rate = target * fleet_capacity(profile, tps) / mean_work
    requests = workload.generate(count, rate, args.seed, args.duration)
    return _scenario(args.workload, requests, profile, tps)


def run_policy(
    scenario: Scenario,
    name: str,
    config: PrefixmeshConfig,
    factory: PolicyFactory,
    registry_lag_s: float,
    seed: int,
    shared_blocks: int = 0,
    cpu_policy: str | None = None,
    lookahead: int | None = None,
) -> tuple[PolicyMetrics, list[float], dict[str, float]]:
    profile = scenario.profile
    policy = factory(name, config.routing, rng=random.Random(seed), block_size=profile.block_size)

    def cpu_tier(clock: Clock) -> TierPolicy:
        return make_tier_policy(
            config.kvcache,
            clock=clock,
            block_tokens=profile.block_size,
            capacities=(profile.cpu_blocks,),
            name=cpu_policy,
            lookahead_requests=lookahead,
        )

    sim_config = SimConfig(
        profile,
        scenario.tp_degrees,
        registry_lag_s=registry_lag_s,
        speculative_ttl_s=config.registry.speculative_ttl_s,
        hotness_half_life_s=config.registry.hotness_half_life_s,
        max_holders_per_block=config.registry.max_holders_per_block,
        shared_blocks=shared_blocks,
        cpu_policy=cpu_tier if profile.cpu_blocks else None,
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    result = ClusterSim(sim_config, policy).run(scenario.requests)
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    metrics = compute_metrics(result, scenario.oracle)
    ttfts = [o.record.ttft_s or 0.0 for o in result.outcomes]
    return metrics, ttfts, {"wall_s": wall_s, "cpu_s": cpu_s, "sim_events": float(result.events)}


def _default_factory() -> PolicyFactory:
    try:
        from prefixmesh.router.policy import make_policy  # type: ignore[attr-defined]
    except ImportError as exc:
        raise SystemExit(f"routing policies are not available yet: {exc}") from None
    return make_policy  # type: ignore[no-any-return]


def format_table(
    scenario: Scenario,
    rows: dict[str, PolicyMetrics],
    walls: dict[str, float],
    oracle_hit_rate: float,
    floor_s: float,
) -> str:
    tps = sorted(set(scenario.tp_degrees))
    lines = [
        f"{scenario.name}: {len(scenario.requests)} requests, {len(scenario.tp_degrees)} x "
        f"{scenario.profile.name} (tp {','.join(map(str, tps))}), "
        f"{scenario.rate_per_s:.2f} req/s, offered load {scenario.offered_load:.2f}",
        f"oracle hit rate {oracle_hit_rate:.1%}   TTFT floor {floor_s * 1000:.1f} ms",
        "",
        f"{'policy':<12} {'hit':>6} {'ttft_mean':>10} {'ttft_p50':>9} {'ttft_p99':>9} "
        f"{'out_tok/s':>10} {'imbalance':>9} {'redundant_prefill':>17} {'requests':>8} "
        f"{'wall_s':>7}",
    ]
    for name, m in rows.items():
        lines.append(
            f"{name:<12} {m.hit_rate:>6.1%} {m.ttft_mean_s:>10.4f} {m.ttft_p50_s:>9.4f} "
            f"{m.ttft_p99_s:>9.4f} {m.throughput_tok_s:>10.0f} {m.load_imbalance:>9.2f} "
            f"{m.redundant_prefill_tokens:>17,} {m.requests:>8} {walls[name]:>7.1f}"
        )
    return "\n".join(lines)


def main(
    argv: list[str], prog: str = "simulate", *, policy_factory: PolicyFactory | None = None
) -> int:
    args = parse_args(argv, prog)
    config = load_config(args.config, args.set)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_POLICIES and policy_factory is None]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    factory = policy_factory or _default_factory()
    scenario = build_scenario(args)
    if not scenario.requests:
        raise SystemExit("no requests to simulate")
    oracle = scenario.oracle
    floor_s = ttft_floor_s(scenario.requests, oracle, scenario.profile, max(scenario.tp_degrees))
    rows: dict[str, PolicyMetrics] = {}
    ttfts: dict[str, list[float]] = {}
    runs: dict[str, dict[str, float]] = {}
    for name in names:
        rows[name], ttfts[name], runs[name] = run_policy(
            scenario,
            name,
            config,
            factory,
            args.registry_lag_s,
            args.seed,
            args.shared_blocks,
            args.cpu_policy,
            args.lookahead,
        )
    walls = {n: r["wall_s"] for n, r in runs.items()}
    print(format_table(scenario, rows, walls, oracle.hit_rate, floor_s))
    if args.json:
        report = {
            "policies": {n: m.summary() for n, m in rows.items()},
            "details": {n: {**m.details(), **runs[n]} for n, m in rows.items()},
            "oracle_hit_rate": oracle.hit_rate,
            "ttft_floor_s": floor_s,
            "offered_load": scenario.offered_load,
            "params": {
                "source": scenario.name,
                "requests": len(scenario.requests),
                "replicas": len(scenario.tp_degrees),
                "tp_degrees": list(scenario.tp_degrees),
                "profile": scenario.profile.name,
                "cpu_blocks": scenario.profile.cpu_blocks,
                "cpu_policy": args.cpu_policy or config.kvcache.policy,
                "lookahead": (
                    config.kvcache.lookahead_requests if args.lookahead is None else args.lookahead
                ),
                "shared_blocks": args.shared_blocks,
                "shared_gb_per_s": args.shared_gb_per_s if args.shared_blocks else None,
                "rate_per_s": scenario.rate_per_s,
                "load": args.load,
                "registry_lag_s": args.registry_lag_s,
                "seed": args.seed,
                "workload_params": _params(args.param),
                "routing": config.routing.model_dump(),
            },
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from prefixmesh.loadtest.plot import plot_ttft

        title = f"{scenario.name}: {len(scenario.tp_degrees)} x {scenario.profile.name}"
        plot_ttft(ttfts, args.plot, title, floor_s)
    return 0
