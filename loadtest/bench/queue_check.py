"""``prefixmesh tier-bench --queue-check``: requests that wait in vLLM's queue behind a long
prefill, whose prefixes sit on disk: what their first token costs with and without the
promotion ahead (``kvcache.prefetch_blocks``), which reads their disk blocks into the CPU tier
while the prefill keeps the loader otherwise idle.

One vLLM engine (in this process) per variant, a step budget of ``--queue-step-tokens`` tokens,
a disk tier that holds everything and a CPU tier with room for one round's waiting prefixes.
``--prefixes`` prompts of ``--prefix-tokens`` tokens are computed, then as many flush prompts
again, so the prefixes are in neither the engine's cache nor the CPU tier: only on disk. Then
``--rounds`` rounds: a cold prompt of ``--queue-long-tokens`` tokens (its prefill spends every
step's budget) and, 50 ms later, ``--queue-waiting`` requests for prefixes not asked before,
each with a fresh 32-token question and one output token; with ``--drop-caches`` the page cache
is dropped before each round, so every disk read is real.

Per waiting request: its TTFT from arrival, and its first token after the long prompt's (what
it costs once its turn comes); the long prompt's TTFT (whether the promotions slow the compute
they run beside); the connector's counts (blocks from the CPU tier, from disk, promoted).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixmesh.loadtest.bench.tier import (
    QUESTION_TOKENS,
    drop_page_cache,
    page_bytes,
    start_engine,
)

ARRIVAL_GAP_S = 0.05
"""The waiting requests arrive this long after the long prompt (its first chunk runs first)."""
COUNTS = ("cpu_loads", "disk_loads", "prefetched", "prefetch_failed", "async_loads", "layer_loads")


@dataclass(frozen=True, slots=True)
class QueueResult:
    variant: str
    prefetch_blocks: int
    ttft_ms: list[float]
    """Each waiting request: arrival to first token."""
    after_long_ms: list[float]
    """Each waiting request: the long prompt's first token to its own."""
    long_ttft_ms: list[float]
    cached_tokens: list[int]
    counts: dict[str, int]

    def summary(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "prefetch_blocks": self.prefetch_blocks,
            "waiting_requests": len(self.ttft_ms),
            "ttft_ms_mean": round(statistics.fmean(self.ttft_ms), 1),
            "ttft_ms_median": round(statistics.median(self.ttft_ms), 1),
            "after_long_ms_mean": round(statistics.fmean(self.after_long_ms), 1),
            "after_long_ms_median": round(statistics.median(self.after_long_ms), 1),
            "long_ttft_ms_mean": round(statistics.fmean(self.long_ttft_ms), 1),
            "cached_tokens_mean": round(statistics.fmean(self.cached_tokens), 1),
            **self.counts,
        }


async def run_queue(
    args: argparse.Namespace, model_path: Path, disk_dir: Path, prefetch_blocks: int
) -> QueueResult:
    from prefixmesh.replica.engines.base import EngineRequest
    from prefixmesh.wire import SamplingSettings

    block = args.block_size
    page = page_bytes(model_path, block)
    prompt_blocks = (args.prefix_tokens + QUESTION_TOKENS) // block + 1
    long_blocks = args.queue_long_tokens // block + 1
    waiting = args.queue_waiting
    # The engine holds the long prompt and one round's waiting requests, and not much more.
    engine_blocks = long_blocks + (waiting + 1) * prompt_blocks
    all_gib = 3 * args.prefixes * prompt_blocks * page / 2**30
    cpu_gib = (waiting + 1) * prompt_blocks * page / 2**30
    variant = f"prefetch-{prefetch_blocks}"
    engine = await start_engine(
        args,
        model_path,
        engine_blocks * page,
        {
            "policy": "lru",
            "cpu_tier_gib": cpu_gib,
            "disk_tier_gib": all_gib,
            "disk_dir": str(disk_dir / variant),
            "prefetch_blocks": prefetch_blocks,
            "layerwise_loads": not args.queue_beside,
        },
        max_model_len=max(args.queue_long_tokens, args.prefix_tokens + QUESTION_TOKENS) + 64,
        step_tokens=args.queue_step_tokens,
    )
    rng = random.Random(3)  # the same prompts for every variant

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 8000) for _ in range(n))

    async def ask(request_id: str, prompt: tuple[int, ...]) -> tuple[float, int]:
        """(its first token's time, its cached prompt tokens)"""
        first = 0.0
        cached = 0
        sampling = SamplingSettings(max_tokens=1, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(EngineRequest(request_id, prompt, sampling)):
            first = first or time.perf_counter()
            cached = max(cached, chunk.num_cached_tokens)
        return first, cached

    prefixes = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
    ttft: list[float] = []
    after_long: list[float] = []
    long_ttft: list[float] = []
    cached_tokens: list[int] = []
    try:
        for i, prefix in enumerate(prefixes):  # into the engine and the tiers
            await ask(f"fill-{i}", prefix + tokens(QUESTION_TOKENS))
        for i in range(args.prefixes):  # pushes them out of the engine and the CPU tier
            await ask(f"flush-{i}", tokens(args.prefix_tokens + QUESTION_TOKENS))
        before = dict(engine.load().connector_stats)
        for rnd in range(args.rounds):
            chosen = prefixes[rnd * waiting : (rnd + 1) * waiting]
            if len(chosen) < waiting:
                break
            if args.drop_caches:
                await asyncio.to_thread(drop_page_cache)
            start = time.perf_counter()
            long = asyncio.create_task(ask(f"long-{rnd}", tokens(args.queue_long_tokens)))
            await asyncio.sleep(ARRIVAL_GAP_S)
            arrived = time.perf_counter()
            asked = [
                ask(f"waiting-{rnd}-{j}", prefix + tokens(QUESTION_TOKENS))
                for j, prefix in enumerate(chosen)
            ]
            results = await asyncio.gather(*asked)
            long_first, _ = await long
            long_ttft.append((long_first - start) * 1e3)
            for first, cached in results:
                ttft.append((first - arrived) * 1e3)
                after_long.append((first - long_first) * 1e3)
                cached_tokens.append(cached)
        await ask("after", tokens(16))  # its step reports the last counts
        after = dict(engine.load().connector_stats)
    finally:
        await engine.shutdown()
    counts = {key: after.get(key, 0) - before.get(key, 0) for key in COUNTS}
    return QueueResult(variant, prefetch_blocks, ttft, after_long, long_ttft, cached_tokens, counts)
