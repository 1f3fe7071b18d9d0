"""``prefixmesh policy-bench``: the time of one ``route()`` decision, per policy.

The scenario is a busy fleet (64 replicas by default, a quarter of them tensor-parallel with
twice the prefill rate) serving prompts from Zipf-popular prefix groups: a shared 1,024-token
head plus a private suffix. Every decision gets fresh load numbers and a registry view shaped
like a real lookup: the group's holders (more for hotter groups, some blocks in CPU or disk),
now and then a replica still computing the whole prompt (speculative), and the group's rate.
Scenarios are built before timing; only ``route`` is timed, ``on_routed`` runs between calls
so that the routing-history trees fill up as in service.

Between two decisions a router sees only a few replicas' load change: the one it just routed
to, and the load reports that came in meanwhile. ``--changed N`` replaces N replicas' snapshots
per decision (new objects, as the adapters make them) and keeps the others' (the same frozen
objects); ``--changed`` equal to ``--replicas`` gives every decision a whole new fleet, the
worst case.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixmesh.cache_registry.types import BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.cli_help import command_parser
from prefixmesh.config import RoutingConfig
from prefixmesh.router.policy import POLICY_NAMES, make_policy
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteRequest,
)

TP1 = ReplicaCapacity(
    prefill_tokens_per_s=12_000.0, decode_step_s=0.02, max_batch_tokens=8192, kv_blocks=40_000
)
TP2 = ReplicaCapacity(
    prefill_tokens_per_s=24_000.0,
    decode_step_s=0.014,
    max_batch_tokens=8192,
    kv_blocks=90_000,
    tp_degree=2,
    cpu_load_s_per_block=0.0004,
)
HEAD_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Scenario:
    request: RouteRequest
    replicas: list[ReplicaSnapshot]
    view: RegistryView


@dataclass(frozen=True)
class PolicyTiming:
    policy: str
    replicas: int
    decisions: int
    mean_us: float
    p50_us: float
    p99_us: float
    cpu_mean_us: float
    """Mean thread CPU time of a decision: what the code costs even when other processes share
    the machine (they inflate the wall-clock mean and p99, not this)."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_scenarios(
    rng: random.Random,
    *,
    replicas: int,
    groups: int,
    block_size: int,
    count: int,
    changed: int | None = None,
) -> list[Scenario]:
    """``count`` decisions; each one's snapshots differ from the previous one's in ``changed``
    random replicas (None: in all of them)."""
    ids = [ReplicaId(f"replica-{i:03d}") for i in range(replicas)]
    capacities = [TP2 if i % 4 == 0 else TP1 for i in range(replicas)]
    head_blocks = HEAD_TOKENS // block_size
    heads = [[BlockHash(rng.getrandbits(64)) for _ in range(head_blocks)] for _ in range(groups)]
    weights = [1.0 / (rank + 1) for rank in range(groups)]  # Zipf, s = 1
    total_weight = sum(weights)
    holders_of = [
        rng.sample(ids, max(1, min(replicas, round(16 * weights[g] * 4)))) for g in range(groups)
    ]
    scenarios = []
    for n in range(count):
        group = rng.choices(range(groups), weights)[0]
        suffix_tokens = rng.randint(256, 2048)
        prompt_tokens = HEAD_TOKENS + suffix_tokens
        suffix = [BlockHash(rng.getrandbits(64)) for _ in range(suffix_tokens // block_size)]
        key = PrefixKey((*heads[group], *suffix), block_size)
        request = RouteRequest(f"q{n}", key, prompt_tokens, rng.randint(64, 512))
        hits: dict[ReplicaId, PrefixHit] = {}
        for holder in holders_of[group]:
            gpu = rng.randint(head_blocks // 2, head_blocks)
            cpu = rng.randint(0, head_blocks - gpu)
            hits[holder] = PrefixHit(gpu + cpu, (gpu, cpu, 0), 0)
        if rng.random() < 0.05:  # a sibling is being computed right now
            holder = rng.choice(ids)
            hits[holder] = PrefixHit(len(key), (len(key), 0, 0), len(key) - head_blocks)
        fresh = [
            ReplicaSnapshot(
                replica_id,
                capacity,
                queued_requests=rng.randint(0, 6),
                running_requests=rng.randint(4, 64),
                pending_prefill_tokens=rng.randint(0, 24_000),
                active_kv_blocks=rng.randint(1_000, 30_000),
            )
            for replica_id, capacity in zip(ids, capacities, strict=True)
        ]
        if changed is None or not scenarios or changed >= replicas:
            snapshots = fresh
        else:
            snapshots = list(scenarios[-1].replicas)
            for position in rng.sample(range(replicas), changed):
                snapshots[position] = fresh[position]
        group_rate = 6.0 * weights[group] / total_weight * groups**0.5
        scenarios.append(Scenario(request, snapshots, RegistryView(hits, group_rate)))
    return scenarios


def time_policy(name: str, scenarios: list[Scenario], decisions: int, seed: int) -> PolicyTiming:
    policy = make_policy(
        name,
        RoutingConfig(),
        rng=random.Random(seed),
        block_size=scenarios[0].request.key.block_size,
    )
    warmup = min(500, len(scenarios))
    samples: list[float] = []
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()  # a collection inside one call would be noise, not the policy's cost
    try:
        for n in range(warmup + decisions):
            scenario = scenarios[n % len(scenarios)]
            started = clock()
            decision = policy.route(scenario.request, scenario.replicas, scenario.view, n * 0.01)
            elapsed = clock() - started
            policy.on_routed(scenario.request, decision.chosen, n * 0.01)
            if n >= warmup:
                samples.append(elapsed / 1000)
        # A second pass, timed as a whole in thread CPU time (a per-call CPU clock is a system
        # call that would dwarf the cheap policies); the routing history is warm by now.
        cpu_started = time.thread_time_ns()
        for n in range(decisions):
            scenario = scenarios[n % len(scenarios)]
            policy.route(scenario.request, scenario.replicas, scenario.view, n * 0.01)
        cpu_total_ns = time.thread_time_ns() - cpu_started
    finally:
        gc.enable()
    return PolicyTiming(
        policy=name,
        replicas=len(scenarios[0].replicas),
        decisions=decisions,
        mean_us=statistics.fmean(samples),
        p50_us=percentile(samples, 0.50),
        p99_us=percentile(samples, 0.99),
        cpu_mean_us=cpu_total_ns / 1000 / decisions,
    )


def main(argv: list[str], prog: str = "prefixmesh policy-bench") -> int:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--replicas", type=int, default=64, help="fleet size")
    parser.add_argument("--decisions", type=int, default=20_000, help="timed decisions per policy")
    parser.add_argument(
        "--scenarios",
        type=int,
        default=2_000,
        help="distinct requests and registry views, built before timing and cycled",
    )
    parser.add_argument("--groups", type=int, default=200, help="prefix groups (Zipf-popular)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help=f"tokens per KV block; divides the {HEAD_TOKENS}-token group head",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenarios and policies")
    parser.add_argument(
        "--changed",
        type=int,
        default=4,
        help="replicas whose load changes between two decisions (= --replicas: all)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=POLICY_NAMES,
        default=list(POLICY_NAMES),
        metavar="POLICY",
        help=f"routing policies to time, space-separated, of {', '.join(POLICY_NAMES)}",
    )
    parser.add_argument("--json", type=Path, help="also write the results here (default: none)")
    args = parser.parse_args(argv)
    if min(args.replicas, args.decisions, args.scenarios, args.groups, args.changed) < 1:
        parser.error("--replicas, --decisions, --scenarios, --groups and --changed must be >= 1")
    if HEAD_TOKENS % args.block_size:
        parser.error(f"--block-size must divide the {HEAD_TOKENS}-token group head")

    scenarios = build_scenarios(
        random.Random(args.seed),
        replicas=args.replicas,
        groups=args.groups,
        block_size=args.block_size,
        count=args.scenarios,
        changed=args.changed,
    )
    results = [time_policy(name, scenarios, args.decisions, args.seed) for name in args.policies]
    changed = min(args.changed, args.replicas)
    print(
        f"one route() decision, {args.replicas} replicas ({changed} with new load per "
        f"decision), {args.decisions} decisions each"
    )
    print(f"{'policy':<12} {'mean us':>9} {'p50 us':>9} {'p99 us':>9} {'cpu mean us':>12}")
    for result in results:
        print(
            f"{result.policy:<12} {result.mean_us:>9.1f} {result.p50_us:>9.1f} "
            f"{result.p99_us:>9.1f} {result.cpu_mean_us:>12.1f}"
        )
    if args.json:
        payload = {
            "python": sys.version.split()[0],
            "block_size": args.block_size,
            "changed_per_decision": changed,
            "groups": args.groups,
            "results": [asdict(result) for result in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0
