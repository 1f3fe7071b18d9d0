"""``prefixmesh tier-bench``: TTFT of a vLLM engine without and with our KV connector's tiers.

A workload that defeats the engine's own cache: ``--prefixes`` prompts of ``--prefix-tokens``
tokens (random token ids, so nothing is shared between them), asked in turn, each with a fresh
32-token question, for ``--rounds`` rounds, one request at a time; the engine's cache holds
``--engine-prompts`` of them. Round 0 computes every prefix (the recompute cost); later rounds
find it in the engine (never, with LRU and more prefixes than fit), the CPU tier or the disk
tier. Each variant runs its own engine on the same prompts; TTFT is measured at the engine
(``AsyncLLM`` in this process), without HTTP or Ray in the way.

``--stall-check`` measures something else: whether requests already decoding keep their pace
while another request's prefix loads from a tier (``stall.py``). ``--queue-check``: what
requests waiting behind a long prefill with their prefixes on disk pay for their first token,
with and without their blocks promoted into the CPU tier while they wait (``queue_check.py``).

Variants: ``none`` (the engine's cache alone), ``cpu`` (a CPU tier that holds every prefix;
on CPU engines its loads run inside the step, layer by layer), ``cpu-beside`` (the same with
``kvcache.layerwise_loads`` off: each load runs beside the batch and the request joins it
after), ``disk`` (a disk tier alone, so every later hit is a disk read). ``--drop-caches`` asks the
kernel to drop its page cache before each disk-variant request (root only), so disk hits are
real reads rather than page-cache copies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixmesh.cli_help import command_parser
from prefixmesh.config import ENGINE_BLOCK_SIZES, load_config
from prefixmesh.replica.kvcache.policy import POLICY_NAMES as CACHE_POLICY_NAMES

QUESTION_TOKENS = 32
VARIANTS = ("none", "cpu", "cpu-beside", "disk")


@dataclass(frozen=True, slots=True)
class VariantResult:
    variant: str
    engine_blocks: int
    cpu_tier_gib: float
    disk_tier_gib: float
    cold_ttft_ms: list[float]
    """Round 0: every prefix computed."""
    warm_ttft_ms: list[float]
    """Rounds 1..: what the tiers (or the engine) give back."""
    cached_tokens_mean: float
    """Prompt tokens served from a cache in rounds 1.., per request."""
    external_hit_tokens: int
    connector: dict[str, int]
    """The KV connector's counts over the run (``EngineLoad.connector_stats``)."""

    @property
    def cold_mean_ms(self) -> float:
        return statistics.fmean(self.cold_ttft_ms)

    @property
    def warm_mean_ms(self) -> float:
        return statistics.fmean(self.warm_ttft_ms)


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    p = command_parser(prog, __doc__)
    p.add_argument(
        "--model-size", choices=("tiny", "small"), default="small", help="the demo model's size"
    )
    p.add_argument("--prefixes", type=int, default=16, help="distinct prefix prompts")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="tokens per prefix prompt")
    p.add_argument(
        "--engine-prompts",
        type=int,
        default=4,
        help="the engine's KV cache size, in prefix prompts",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds over every prefix, the first one cold"
    )
    p.add_argument(
        "--variants",
        default="none,cpu,disk",
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--policy",
        choices=CACHE_POLICY_NAMES,
        default="lru",
        help="kvcache.policy of the KV connector's tiers",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=ENGINE_BLOCK_SIZES["vllm"],
        help="tokens per KV block; vLLM's, as the replicas run it",
    )
    p.add_argument(
        "--cpu-cores",
        default=None,
        help="vLLM CPU worker's cores for every variant, e.g. 0-1 (default: none, all of them); "
        "vLLM's own choice differs with and without a KV connector (1 vs 2 cores on a 2-core "
        "machine)",
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the kernel's page cache before each disk-variant request, so disk hits are "
        "real reads (root only)",
    )
    p.add_argument(
        "--disk-dir",
        default=None,
        help="the disk tier's folder (default: none, a fresh temporary one)",
    )
    p.add_argument("--json", default=None, help="write the results here, JSON (default: none)")
    _add_stall_args(p)
    _add_queue_args(p)
    args = p.parse_args(argv)
    if args.prefix_tokens % args.block_size or args.prefix_tokens <= 0:
        p.error("--prefix-tokens must be a positive multiple of --block-size")
    if not set(args.variants.split(",")) <= set(VARIANTS):
        p.error(f"--variants: a comma-separated subset of {','.join(VARIANTS)}")
    return args


def _add_stall_args(p: argparse.ArgumentParser) -> None:
    stall = p.add_argument_group("stall check (loadtest/bench/stall.py)")
    stall.add_argument(
        "--stall-check",
        action="store_true",
        help="instead of the variants: decode steps of running requests while prefixes load",
    )
    stall.add_argument(
        "--stall-check-sync",
        action="store_true",
        help="also run it with loads inside the step that needs them (kvcache.async_loads off)",
    )
    stall.add_argument(
        "--stall-tier",
        choices=("disk", "cpu"),
        default="disk",
        help="the lower tier that holds every prefix",
    )
    stall.add_argument(
        "--decoders", type=int, default=4, help="requests decoding side by side meanwhile"
    )
    stall.add_argument(
        "--decode-tokens", type=int, default=800, help="output tokens per decoding request"
    )


def _add_queue_args(p: argparse.ArgumentParser) -> None:
    queue = p.add_argument_group("queue check (loadtest/bench/queue_check.py)")
    queue.add_argument(
        "--queue-check",
        action="store_true",
        help="instead of the variants: requests waiting behind a long prefill, prefixes on disk,"
        " with kvcache.prefetch_blocks 0 and --queue-prefetch-blocks",
    )
    queue.add_argument(
        "--queue-waiting",
        type=int,
        default=4,
        help="requests waiting behind the long prompt, per round",
    )
    queue.add_argument(
        "--queue-long-tokens", type=int, default=3968, help="tokens of the long cold prompt"
    )
    queue.add_argument(
        "--queue-step-tokens", type=int, default=512, help="the engine step's budget, in tokens"
    )
    queue.add_argument(
        "--queue-prefetch-blocks",
        type=int,
        default=256,
        help="kvcache.prefetch_blocks of the variant with promotions, in blocks",
    )
    queue.add_argument(
        "--queue-beside",
        action="store_true",
        help="both variants with kvcache.layerwise_loads off: every load beside the batch",
    )
    queue.add_argument(
        "--queue-runs",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: each variant once, without then with promotions; 2: both twice, in the order "
        "without, with, with, without",
    )


def page_bytes(model_path: Path, block_size: int) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * block_size


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


async def start_engine(
    args: argparse.Namespace,
    model_path: Path,
    kv_cache_bytes: int,
    kvcache: dict[str, Any],
    max_model_len: int | None = None,
    step_tokens: int = 8192,
) -> Any:
    """A started ``VllmEngine`` (in this process's event loop) with these ``kvcache`` settings
    for our KV connector (none when no tier is on)."""
    from prefixmesh.cache_registry.factory import make_hasher
    from prefixmesh.replica.engines.vllm_engine import VllmEngine, VllmEngineSettings
    from prefixmesh.replica.kvcache.connector import connector_extra_config

    cfg = load_config(None, {"cache": {"block_size": args.block_size}, "kvcache": kvcache})
    # A generous prefill guess: loads are chosen only when they beat it (they do by far).
    extra = connector_extra_config(cfg, 30_000.0) if cfg.kvcache.tiers_enabled else None
    settings = VllmEngineSettings(
        model_path=str(model_path),
        block_size=args.block_size,
        max_model_len=max_model_len or args.prefix_tokens + QUESTION_TOKENS + 64,
        kv_cache_bytes=kv_cache_bytes,
        enforce_eager=True,
        tensor_parallel_size=1,
        cpu_core=None,
        calibrate=False,
        max_num_batched_tokens=step_tokens,
        kv_connector_extra=extra,
    )
    engine = VllmEngine(settings, make_hasher(cfg), lambda changes: None)
    await engine.start()
    return engine


async def run_variant(
    variant: str, args: argparse.Namespace, model_path: Path, disk_dir: Path
) -> VariantResult:
    from prefixmesh.replica.engines.base import EngineRequest
    from prefixmesh.wire import SamplingSettings

    block = args.block_size
    page = page_bytes(model_path, block)
    prompt_blocks = (args.prefix_tokens + QUESTION_TOKENS) // block + 1
    engine_blocks = args.engine_prompts * prompt_blocks
    all_prefixes_gib = args.prefixes * prompt_blocks * page / 2**30 * 1.1
    cpu_gib = all_prefixes_gib if variant.startswith("cpu") else 0.0
    disk_gib = all_prefixes_gib if variant == "disk" else 0.0
    engine = await start_engine(
        args,
        model_path,
        engine_blocks * page,
        {
            "policy": args.policy,
            "cpu_tier_gib": cpu_gib,
            "disk_tier_gib": disk_gib,
            "disk_dir": str(disk_dir / variant),
            "layerwise_loads": variant != "cpu-beside",
        },
    )
    rng = random.Random(0)  # the same prompts for every variant
    prefixes = [
        tuple(rng.randrange(3, 8000) for _ in range(args.prefix_tokens))
        for _ in range(args.prefixes)
    ]
    cold: list[float] = []
    warm: list[float] = []
    cached_total = 0
    try:
        for rnd in range(args.rounds):
            for i, prefix in enumerate(prefixes):
                question = tuple(rng.randrange(3, 8000) for _ in range(QUESTION_TOKENS))
                if variant == "disk" and args.drop_caches and rnd:
                    await asyncio.to_thread(drop_page_cache)
                request = EngineRequest(
                    f"{variant}-{rnd}-{i}",
                    prefix + question,
                    SamplingSettings(max_tokens=2, temperature=0.0, ignore_eos=True),
                )
                start = time.perf_counter()
                first: float | None = None
                cached = 0
                async for chunk in engine.generate(request):
                    if first is None:
                        first = time.perf_counter() - start
                    cached = max(cached, chunk.num_cached_tokens)
                assert first is not None
                (cold if rnd == 0 else warm).append(first * 1e3)
                if rnd:
                    cached_total += cached
        load = engine.load()
        external = load.external_prefix_cache_hit_tokens
        counts = dict(load.connector_stats)
    finally:
        await engine.shutdown()
    return VariantResult(
        variant,
        engine_blocks,
        round(cpu_gib, 4),
        round(disk_gib, 4),
        cold,
        warm,
        cached_total / max(1, len(warm)),
        external,
        counts,
    )


def report(results: list[VariantResult]) -> str:
    lines = [
        "| variant | cold TTFT mean (ms) | later rounds mean (ms) | p50 | cached tokens/request"
        " | vs none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = next((r for r in results if r.variant == "none"), None)
    for r in results:
        ratio = f"{r.warm_mean_ms / base.warm_mean_ms:.3f}x" if base else "-"
        lines.append(
            f"| {r.variant} | {r.cold_mean_ms:.1f} | {r.warm_mean_ms:.1f} | "
            f"{statistics.median(r.warm_ttft_ms):.1f} | {r.cached_tokens_mean:.0f} | {ratio} |"
        )
    lines += [
        f"\ndisk hit / recompute (same engine, same prompts): "
        f"{r.warm_mean_ms / r.cold_mean_ms:.3f}x"
        for r in results
        if r.variant == "disk"
    ]
    return "\n".join(lines)


def main(argv: list[str], prog: str = "tier-bench") -> int:
    args = parse_args(argv, prog)
    cores = args.cpu_cores or f"0-{(os.cpu_count() or 1) - 1}"
    # Read by vLLM's CPU worker when it starts: the same cores with and without the connector.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from prefixmesh.replica.demo_model import ensure_demo_model

    cfg = load_config()
    model_path = ensure_demo_model(Path(cfg.cache_dir).expanduser() / "models", args.model_size)
    if args.stall_check:
        return stall_check(args, model_path)
    if args.queue_check:
        return queue_check(args, model_path)
    results: list[VariantResult] = []
    with tempfile.TemporaryDirectory(prefix="prefixmesh-tiers-") as scratch:
        disk_dir = Path(args.disk_dir) if args.disk_dir else Path(scratch)
        for variant in args.variants.split(","):
            result = asyncio.run(run_variant(variant, args, model_path, disk_dir))
            results.append(result)
            print(
                f"{variant}: cold {result.cold_mean_ms:.1f} ms, later {result.warm_mean_ms:.1f}"
                f" ms, {result.cached_tokens_mean:.0f} cached tokens/request, connector"
                f" {result.connector}",
                flush=True,
            )
            if args.json:  # after every variant: a long run cut short keeps what it measured
                out: dict[str, Any] = {"args": vars(args), "results": [asdict(r) for r in results]}
                Path(args.json).write_text(json.dumps(out, indent=2))
    print(report(results))
    return 0


def stall_check(args: argparse.Namespace, model_path: Path) -> int:
    from prefixmesh.loadtest.bench.stall import run_stall

    summaries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prefixmesh-stall-") as scratch:
        disk_dir = Path(args.disk_dir) if args.disk_dir else Path(scratch)
        for async_loads in (True, False) if args.stall_check_sync else (True,):
            result = asyncio.run(run_stall(args, model_path, disk_dir, async_loads))
            summaries.append(result.summary())
            print(json.dumps(summaries[-1]), flush=True)
    if args.json:
        out = {
            "args": vars(args),
            "decode_step_ratio": summaries[0]["decode_step_ratio"],
            "runs": summaries,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def queue_check(args: argparse.Namespace, model_path: Path) -> int:
    from prefixmesh.loadtest.bench.queue_check import run_queue

    with_blocks = args.queue_prefetch_blocks
    order = (0, with_blocks) if args.queue_runs == 1 else (0, with_blocks, with_blocks, 0)
    summaries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prefixmesh-queue-") as scratch:
        for run, blocks in enumerate(order):
            disk_dir = Path(args.disk_dir or scratch) / f"run{run}"
            result = asyncio.run(run_queue(args, model_path, disk_dir, blocks))
            summaries.append(result.summary())
            print(json.dumps(summaries[-1]), flush=True)

    def mean_of(key: str, blocks: int) -> float:
        return statistics.fmean(s[key] for s in summaries if s["prefetch_blocks"] == blocks)

    ratios = {
        f"{name}_ratio": round(
            mean_of(f"{name}_ms_mean", with_blocks) / mean_of(f"{name}_ms_mean", 0), 3
        )
        for name in ("after_long", "ttft", "long_ttft")
    }
    print(json.dumps(ratios), flush=True)
    if args.json:
        out = {"args": vars(args), **ratios, "runs": summaries}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
