"""``prefixmesh cache-sim``, the cache simulator's CLI: hierarchical cache policies replayed on a
trace or a workload.

Every policy sees the same requests on identical empty tiers (the cache simulator,
``replica/kvcache/cache_sim.py``): the engine tier, then the lower tiers, with capacities in
blocks. Rows report the leading-prefix hit rate (overall and by the tier that held the block),
the blocks written to the lower tiers and the blocks moved up into the engine tier.
``--capacity-fraction`` sizes the engine tier as a fraction of the distinct blocks the requests
use, with lower tiers ``--lower-tiers`` times as large (default one CPU tier the engine tier's
size, HotPrefix's setting).

Every row is also read against two references run on the same tiers: LRU (``vs_lru``, its
ratio) and Belady, the offline policy that knows the whole replay (``share_of_belady_gain``:
(policy - LRU) / (Belady - LRU), so LRU is 0 and Belady 1). The replay's next uses are computed
once here (``future_uses``), before any policy runs. ``--policies all`` runs every policy,
``--policies default`` the configured ``kvcache.policy``, which the JSON names
(``default_policy``).

``--lookahead N1,N2,...`` adds, for every online row, one row per N where the policy also sees
the N requests after the running one (``Lookahead``: a backlog of N at the router and in the
engine's waiting queue: its blocks go last, the one needed furthest ahead first).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.cli_help import command_parser
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.loadtest.cli_args import add_config_args, add_source_args
from prefixmesh.loadtest.keys import KeyBuilder
from prefixmesh.loadtest.policy_timer import PolicyTimer
from prefixmesh.loadtest.traces import (
    MOONCAKE_BLOCK_TOKENS,
    QWEN_BLOCK_TOKENS,
    TraceFormat,
    detect_format,
    load_trace,
)
from prefixmesh.loadtest.workloads import WorkloadRequest, make_workload
from prefixmesh.replica.kvcache.cache_sim import (
    CacheRequest,
    CacheSimResult,
    TieredCacheSim,
    future_uses,
)
from prefixmesh.replica.kvcache.categories import TurnCategorizer
from prefixmesh.replica.kvcache.policy import (
    POLICY_NAMES,
    BeladyPolicy,
    CachePolicy,
    FutureUses,
    Lookahead,
    LRUPolicy,
    ManualClock,
    RequestQueue,
    make_policy,
)

DEFAULT_REQUESTS = 4000
DEFAULT_WORKLOAD_BLOCK_TOKENS = 16
"""GPU vLLM's block size (anchors-systems 2.7)."""
TIER_NAMES = ("gpu", "cpu", "disk")
BELADY = "belady"
"""The offline reference (not a ``kvcache.policy``: it needs the future)."""
ALL_POLICIES: tuple[str, ...] = (*POLICY_NAMES, BELADY)
MIN_GAIN = 0.001
"""Belady's gain over LRU (hit rate) below which no share of it is reported."""
TRACE_BLOCK_TOKENS: dict[TraceFormat, int] = {
    "mooncake": MOONCAKE_BLOCK_TOKENS,
    "qwen": QWEN_BLOCK_TOKENS,
}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    add_source_args(parser)
    parser.add_argument(
        "--requests",
        type=int,
        help=f"replay at most this many requests (default: none, a trace's every request or "
        f"{DEFAULT_REQUESTS} of a workload)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="a workload's arrivals per second (they order the replay; a trace keeps its own)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's requests")
    parser.add_argument(
        "--block-tokens",
        type=int,
        help=f"tokens per block (default: none, a trace's own, {TRACE_BLOCK_TOKENS['mooncake']} "
        f"for Mooncake and {TRACE_BLOCK_TOKENS['qwen']} for Qwen-Bailian; a workload's "
        f"{DEFAULT_WORKLOAD_BLOCK_TOKENS})",
    )
    _add_tier_args(parser)
    _add_policy_args(parser)
    parser.add_argument(
        "--max-turn",
        type=int,
        default=8,
        help="conversation turns above this one share its category",
    )
    add_config_args(parser, "its kvcache section", set_dest="set")
    parser.add_argument("--json", type=Path, help="write the results here (default: none)")
    parser.add_argument(
        "--plot", type=Path, help="write hit-rate and write charts here, PNG (default: none)"
    )
    args = parser.parse_args(list(argv))
    _check_args(parser, args)
    return args


def _add_tier_args(parser: argparse.ArgumentParser) -> None:
    sizes = parser.add_mutually_exclusive_group(required=True)
    sizes.add_argument(
        "--capacity-blocks",
        action="append",
        metavar="N1,N2,...",
        help="engine tier, then lower tiers, in blocks; repeatable: one run per set",
    )
    sizes.add_argument(
        "--capacity-fraction",
        type=_floats,
        metavar="F1,F2,...",
        help="engine tier as fractions of the distinct blocks, one run per fraction",
    )
    parser.add_argument(
        "--lower-tiers",
        type=_floats,
        default=[1.0],
        metavar="R1,R2,...",
        help="with --capacity-fraction: lower tiers as multiples of the engine tier; 0 or an "
        "empty list: no lower tier",
    )


def _add_policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies",
        default="all",
        help=f"comma-separated, of {', '.join(ALL_POLICIES)}; all: every one; default: the "
        "configured kvcache.policy",
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        nargs="+",
        action="append",
        metavar=("LABEL", "KEY=VALUE"),
        help="instead of --policies: a row named LABEL with these config settings, e.g. "
        "--variant write-all kvcache.policy=hotprefix kvcache.hotprefix.admission=false "
        f"(kvcache.policy={BELADY}: the offline reference); repeatable",
    )
    parser.add_argument(
        "--lookahead",
        type=_ints,
        default=[],
        metavar="N1,N2,...",
        help="also run every online policy seeing the next N queued requests (Lookahead), "
        "one row per N",
    )


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.requests is not None and args.requests <= 0:
        parser.error("--requests must be > 0")
    if args.block_tokens is not None and args.block_tokens <= 0:
        parser.error("--block-tokens must be > 0")
    if args.capacity_fraction is not None and not all(f > 0 for f in args.capacity_fraction):
        parser.error("--capacity-fraction values must be > 0")
    if any(r < 0 for r in args.lower_tiers):
        parser.error("--lower-tiers values must be >= 0")
    if any(n <= 0 for n in args.lookahead):
        parser.error("--lookahead values must be > 0")


# ---- requests -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replay:
    name: str
    block_tokens: int
    requests: list[CacheRequest]
    distinct_blocks: int
    """Distinct blocks the requests store (prompt and answer blocks)."""
    ceiling_hit_rate: float
    """Hit rate of one unbounded cache: no policy can beat it."""


def to_cache_requests(
    requests: Sequence[WorkloadRequest], block_tokens: int, max_turn: int = 8
) -> list[CacheRequest]:
    """Prompts as chained block hashes in arrival order, each with its category (kind and
    turn, the turn read off the prompt: ``TurnCategorizer``) and the answer blocks a later
    prompt repeats."""
    keys = KeyBuilder(block_tokens)
    categories = TurnCategorizer(max_turn)
    out = []
    for request in sorted(requests, key=lambda r: r.arrival_s):
        prompt = keys.key(request.segments).block_hashes
        answer: tuple[BlockHash, ...] = ()
        if request.finish_segments is not None:
            full = keys.key(request.finish_segments).block_hashes
            if full[: len(prompt)] == prompt:
                answer = full[len(prompt) :]
        category = categories.category(request.kind or "request", prompt)
        out.append(CacheRequest(prompt, request.arrival_s, category, answer))
    return out


def ceiling_hit_rate(requests: Sequence[CacheRequest]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        for block in request.blocks:
            if block not in seen:
                break
            hits += 1
        total += len(request.blocks)
        seen.update(request.blocks)
        seen.update(request.output_blocks)
    return hits / total if total else 0.0


def _params(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param wants FIELD=VALUE, got {item!r}")
        params[key] = yaml.safe_load(value)
    return params


def _trace_format(path: Path, choice: str) -> TraceFormat:
    if choice != "auto":
        return choice
    with path.open() as lines:
        first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise SystemExit(f"{path}: empty trace")
    return detect_format(json.loads(first))


def build_replay(args: argparse.Namespace) -> Replay:
    if args.trace is not None:
        fmt = _trace_format(args.trace, args.trace_format)
        block_tokens = args.block_tokens or TRACE_BLOCK_TOKENS[fmt]
        workload_requests = load_trace(args.trace, fmt)
        if args.requests is not None:
            workload_requests = workload_requests[: args.requests]
        name = args.trace.name
    else:
        workload = make_workload(args.workload, _params(args.param))
        block_tokens = args.block_tokens or DEFAULT_WORKLOAD_BLOCK_TOKENS
        workload_requests = workload.generate(
            args.requests or DEFAULT_REQUESTS, args.rate, args.seed
        )
        name = args.workload
    requests = to_cache_requests(workload_requests, block_tokens, args.max_turn)
    distinct = len({b for r in requests for b in (*r.blocks, *r.output_blocks)})
    return Replay(name, block_tokens, requests, distinct, ceiling_hit_rate(requests))


def capacity_sets(args: argparse.Namespace, distinct_blocks: int) -> list[tuple[int, ...]]:
    if args.capacity_blocks:
        sets = []
        for text in args.capacity_blocks:
            try:
                sizes = tuple(int(v) for v in text.split(","))
            except ValueError:
                raise SystemExit(f"--capacity-blocks wants N1,N2,..., got {text!r}") from None
            if not sizes or sizes[0] <= 0 or any(s < 0 for s in sizes):
                raise SystemExit(f"--capacity-blocks needs an engine tier > 0: {text!r}")
            sets.append(sizes)
        return sets
    out = []
    for fraction in args.capacity_fraction:
        engine = max(1, round(fraction * distinct_blocks))
        lower = [round(ratio * engine) for ratio in args.lower_tiers if ratio > 0]
        out.append((engine, *lower))
    return out


# ---- runs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowSpec:
    label: str
    overrides: list[str]
    """Config settings of the row."""
    belady: bool = False
    """The offline reference instead of the configured ``kvcache.policy``."""
    lookahead: int = 0
    """Queued requests the policy sees (``Lookahead``); 0: none."""

    @property
    def settings(self) -> list[str]:
        """What the row runs, as config settings (the report's ``variants``), and its
        lookahead."""
        settings = [*self.overrides, f"kvcache.policy={BELADY}"] if self.belady else self.overrides
        if not self.lookahead:
            return settings
        return [*settings, f"lookahead={self.lookahead}"]


def policy_names(text: str, default_policy: str) -> list[str]:
    """``--policies``: names, ``all`` and ``default`` expanded, each once, in order."""
    names: list[str] = []
    for item in (n.strip() for n in text.split(",")):
        expanded = (
            ALL_POLICIES if item == "all" else (default_policy,) if item == "default" else (item,)
        )
        names.extend(n for n in expanded if n and n not in names)
    unknown = [n for n in names if n not in ALL_POLICIES]
    if unknown:
        raise SystemExit(
            f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}, all, default"
        )
    return names


def variants(args: argparse.Namespace, default_policy: str) -> list[RowSpec]:
    """The rows to run: ``--variant``s or ``--policies``, then each online one again per
    ``--lookahead``."""
    rows = _base_variants(args, default_policy)
    looking = [
        RowSpec(f"{row.label}+look{n}", row.overrides, lookahead=n)
        for n in args.lookahead
        for row in rows
        if not row.belady
    ]
    return [*rows, *looking]


def _base_variants(args: argparse.Namespace, default_policy: str) -> list[RowSpec]:
    if args.variants:
        rows = []
        for label, *overrides in args.variants:
            reference = f"kvcache.policy={BELADY}"
            rows.append(
                RowSpec(label, [o for o in overrides if o != reference], reference in overrides)
            )
        return rows
    return [
        RowSpec(name, [], belady=True)
        if name == BELADY
        else RowSpec(name, [f"kvcache.policy={name}"])
        for name in policy_names(args.policies, default_policy)
    ]


def make_row_policy(
    spec: RowSpec,
    config: PrefixmeshConfig,
    replay: Replay,
    capacities: tuple[int, ...],
    future: FutureUses,
    clock: ManualClock,
) -> tuple[CachePolicy, RequestQueue | None]:
    """The row's policy, and what it is told of queued requests (with ``--lookahead``)."""
    if spec.belady:
        return BeladyPolicy(future, capacities), None
    policy = make_policy(
        config.kvcache.policy,
        config.kvcache,
        clock=clock,
        block_tokens=replay.block_tokens,
        capacities=capacities,
    )
    if spec.lookahead:
        looking = Lookahead(policy)
        return looking, looking
    return policy, None


def run_policy(
    replay: Replay,
    policy: CachePolicy,
    capacities: tuple[int, ...],
    clock: ManualClock,
    queue: RequestQueue | None = None,
    lookahead: int = 0,
) -> tuple[CacheSimResult, float, PolicyTimer]:
    """One replay on empty tiers; the result, the seconds it took and what the policy's
    decisions cost. ``queue`` is told of the ``lookahead`` requests after the running one."""
    timer = PolicyTimer(policy)
    started = time.perf_counter()
    result = TieredCacheSim(capacities, timer, clock).run(replay.requests, queue, lookahead)
    return result, time.perf_counter() - started, timer


@dataclass(frozen=True, slots=True)
class References:
    """The hit rates every row is read against, on one set of tiers."""

    lru: float
    belady: float

    def vs_lru(self, hit_rate: float) -> float | None:
        return hit_rate / self.lru if self.lru > 0 else None

    def share_of_gain(self, hit_rate: float) -> float | None:
        """(policy - LRU) / (Belady - LRU); None when Belady gains less than ``MIN_GAIN``
        over LRU (a share of a handful of blocks is noise: -31 for a 0.02-point miss)."""
        gain = self.belady - self.lru
        return (hit_rate - self.lru) / gain if gain >= MIN_GAIN else None


def reference_rates(
    replay: Replay,
    capacities: tuple[int, ...],
    future: FutureUses,
    done: dict[str, CacheSimResult],
) -> References:
    """LRU's and Belady's hit rates on ``capacities``, reusing the rows that ran either
    (``done``, by policy name: neither has settings)."""
    lru = done.get("lru")
    if lru is None:
        lru, *_ = run_policy(replay, LRUPolicy(), capacities, ManualClock())
    best = done.get(BELADY)
    if best is None:
        best, *_ = run_policy(replay, BeladyPolicy(future, capacities), capacities, ManualClock())
    return References(lru.hit_rate, best.hit_rate)


def tier_name(tier: int) -> str:
    return TIER_NAMES[tier] if tier < len(TIER_NAMES) else f"tier{tier}"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def result_row(
    label: str,
    result: CacheSimResult,
    wall_s: float,
    references: References,
    timer: PolicyTimer,
) -> dict[str, Any]:
    return {
        "policy": label,
        "capacity_blocks": list(result.capacity_blocks),
        "hit_rate": round(result.hit_rate, 6),
        "vs_lru": _rounded(references.vs_lru(result.hit_rate)),
        "share_of_belady_gain": _rounded(references.share_of_gain(result.hit_rate)),
        "hit_rate_by_tier": {
            tier_name(t): round(rate, 6) for t, rate in enumerate(result.hit_rate_by_tier)
        },
        "blocks_written": result.blocks_written,
        "blocks_promoted": result.blocks_promoted,
        "blocks_loaded": result.blocks_loaded,
        "blocks_promoted_ahead": result.blocks_promoted_ahead,
        "blocks_evicted": result.blocks_evicted,
        "blocks_rejected": result.blocks_rejected,
        "blocks_dropped_orphans": result.blocks_dropped_orphans,
        "requests": result.requests,
        "blocks": result.blocks,
        "wall_s": round(wall_s, 3),
        "victim_us": round(timer.victim_us, 3),
        "on_request_us": round(timer.request_us, 3),
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(replay: Replay, rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{replay.name}: {len(replay.requests)} requests, {replay.block_tokens}-token blocks, "
        f"{replay.distinct_blocks:,} distinct blocks, ceiling hit rate "
        f"{replay.ceiling_hit_rate:.1%}",
        "",
        f"{'policy':<16} {'capacity_blocks':<16} {'hit':>6} {'vs_lru':>6} {'gain':>6} "
        f"{'by_tier':<20} {'written':>8} {'promoted':>8} {'evicted':>8} {'rejected':>8} "
        f"{'wall_s':>6} {'victim_us':>9}",
    ]
    for row in rows:
        capacities = ",".join(map(str, row["capacity_blocks"]))
        by_tier = " ".join(f"{t}={v:.1%}" for t, v in row["hit_rate_by_tier"].items())
        lines.append(
            f"{row['policy']:<16} {capacities:<16} {row['hit_rate']:>6.1%} "
            f"{_ratio(row['vs_lru']):>6} {_ratio(row['share_of_belady_gain']):>6} "
            f"{by_tier:<20} {row['blocks_written']:>8} {row['blocks_promoted']:>8} "
            f"{row['blocks_evicted']:>8} {row['blocks_rejected']:>8} {row['wall_s']:>6.1f} "
            f"{row['victim_us']:>9.2f}"
        )
    lines.append("")
    lines.append("vs_lru: hit rate / LRU's; gain: (hit - LRU) / (Belady - LRU), the offline bound")
    return "\n".join(lines)


def plot_results(replay: Replay, rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit_ax, write_ax) = plt.subplots(1, 2, figsize=(13, 5))
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    for label in labels:
        mine = sorted((r for r in rows if r["policy"] == label), key=lambda r: r["capacity_blocks"])
        xs = [r["capacity_blocks"][0] for r in mine]
        hit_ax.plot(xs, [r["hit_rate"] for r in mine], marker="o", label=label)
        write_ax.plot(xs, [max(1, r["blocks_written"]) for r in mine], marker="o", label=label)
    hit_ax.axhline(replay.ceiling_hit_rate, color="grey", linestyle=":", label="unbounded cache")
    hit_ax.set_xlabel("engine-tier capacity (blocks)")
    hit_ax.set_ylabel("leading-prefix hit rate (all tiers)")
    hit_ax.set_title("hit rate")
    hit_ax.grid(True, alpha=0.3)
    hit_ax.legend(fontsize="small")
    write_ax.set_xlabel("engine-tier capacity (blocks)")
    write_ax.set_ylabel("blocks written to lower tiers (0 drawn as 1)")
    write_ax.set_yscale("log")
    write_ax.set_title("writes to lower tiers")
    write_ax.grid(True, which="both", alpha=0.3)
    write_ax.legend(fontsize="small")
    fig.suptitle(
        f"{replay.name}: {len(replay.requests)} requests, {replay.block_tokens}-token blocks"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str], prog: str = "cache-sim") -> int:
    args = parse_args(argv, prog)
    base = load_config(args.config, args.set)
    default_policy = base.kvcache.policy
    specs = variants(args, default_policy)
    replay = build_replay(args)
    if not replay.requests:
        raise SystemExit("no requests to replay")
    future = future_uses(replay.requests)  # what Belady knows, computed once
    capacities = capacity_sets(args, replay.distinct_blocks)
    rows: list[dict[str, Any]] = []
    references: list[dict[str, Any]] = []
    for sizes in capacities:
        ran: list[tuple[RowSpec, CacheSimResult, float, PolicyTimer]] = []
        done: dict[str, CacheSimResult] = {}
        for spec in specs:
            config = load_config(args.config, [*args.set, *spec.overrides])
            clock = ManualClock()
            policy, queue = make_row_policy(spec, config, replay, sizes, future, clock)
            result, wall_s, timer = run_policy(replay, policy, sizes, clock, queue, spec.lookahead)
            done.setdefault(policy.name, result)
            ran.append((spec, result, wall_s, timer))
        refs = reference_rates(replay, sizes, future, done)
        references.append(
            {"capacity_blocks": list(sizes), "lru_hit_rate": round(refs.lru, 6),
             "belady_hit_rate": round(refs.belady, 6)}
        )  # fmt: skip
        rows.extend(result_row(spec.label, *outcome, refs, timer) for spec, *outcome, timer in ran)
    print(format_table(replay, rows))
    if args.json:
        report = {
            "results": rows,
            "references": references,
            "default_policy": default_policy,
            "source": replay.name,
            "requests": len(replay.requests),
            "block_tokens": replay.block_tokens,
            "distinct_blocks": replay.distinct_blocks,
            "ceiling_hit_rate": round(replay.ceiling_hit_rate, 6),
            "variants": {spec.label: spec.settings for spec in specs},
            "kvcache": base.kvcache.model_dump(),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_results(replay, rows, args.plot)
    return 0
