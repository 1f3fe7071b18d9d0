"""``prefixmesh tier-bench --stall-check``: do the requests already decoding keep their pace
while another request's prefix loads from a lower tier?

One vLLM engine (in this process) with our KV connector and one lower tier that holds every
prefix (the disk tier by default: ``--drop-caches`` makes its reads real). ``--prefixes``
prompts of ``--prefix-tokens`` tokens are computed once, so the engine's small cache keeps only
the last few and the tier has them all. Then ``--decoders`` requests decode side by side
(``ignore_eos``), and while they run, each prefix the engine no longer holds is asked again,
one at a time with a pause between, with a fresh question and one output token: its blocks
come back from the tier. Every decoder's output arrival times give its decode steps (a chunk
of n tokens counts as n steps of its gap over n); a step that ends while a load is in flight
(from the loading request's arrival to its first token) is a step "during a load", one with no
load in flight within a step of it an "idle" one.

``decode_step_ratio`` = median step during loads / median idle step. With asynchronous loads
(``kvcache.async_loads``, the default) the loading request waits outside the batch; with
``--stall-check-sync`` too, the same run with loads inside the step that needs them (what the
connector did before), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

DECODER_PROMPT_TOKENS = 64
LOAD_GAP_S = 0.3
"""Pause between two loads: idle steps to compare with."""


@dataclass(frozen=True, slots=True)
class StallResult:
    mode: str
    """``async`` or ``sync`` loads."""
    tier: str
    prefix_tokens: int
    token_bytes: int
    """KV bytes of one token over every layer."""
    load_ms: list[float]
    """Each loading request: its arrival to its first token."""
    cached_tokens: list[int]
    """Each loading request's prompt tokens served from a cache (its load, not a recompute)."""
    recompute_ms: float
    """The same prefixes computed cold, mean (round 0)."""
    step_ms_during: list[float]
    step_ms_idle: list[float]

    @property
    def decode_step_ratio(self) -> float:
        return statistics.median(self.step_ms_during) / statistics.median(self.step_ms_idle)

    @property
    def load_to_step(self) -> float:
        """How many idle decode steps one load lasts (the issue asks for at least 10)."""
        return statistics.median(self.load_ms) / statistics.median(self.step_ms_idle)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tier": self.tier,
            "prefix_tokens": self.prefix_tokens,
            "load_mib": round(self.prefix_tokens * self.token_bytes / 2**20, 1),
            "loads": len(self.load_ms),
            "load_ms_median": round(statistics.median(self.load_ms), 2),
            "recompute_ms_mean": round(self.recompute_ms, 2),
            "loaded_tokens_median": statistics.median(self.cached_tokens),
            "step_ms_idle_median": round(statistics.median(self.step_ms_idle), 3),
            "step_ms_during_median": round(statistics.median(self.step_ms_during), 3),
            "step_ms_during_max": round(max(self.step_ms_during), 2),
            "steps_idle": len(self.step_ms_idle),
            "steps_during": len(self.step_ms_during),
            "load_to_step": round(self.load_to_step, 1),
            "decode_step_ratio": round(self.decode_step_ratio, 3),
        }


def classify_steps(
    arrivals: list[list[tuple[float, int]]], windows: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """(steps during a load, idle steps) in ms from each decoder's ``(arrival, tokens)`` list:
    a chunk's gap over its token count, during when it ends inside a load window, idle when no
    window is within that gap of it."""
    during: list[float] = []
    idle: list[float] = []
    for chunks in arrivals:
        for (before, _), (at, count) in itertools.pairwise(chunks):
            step = (at - before) / max(1, count)
            if any(start <= at <= end for start, end in windows):
                during += [step * 1e3] * count
            elif not any(start - step <= at and before <= end + step for start, end in windows):
                idle += [step * 1e3] * count
    return during, idle


async def run_stall(
    args: argparse.Namespace, model_path: Path, disk_dir: Path, async_loads: bool
) -> StallResult:
    from prefixmesh.replica.engines.base import EngineRequest
    from prefixmesh.wire import SamplingSettings

    block = args.block_size
    token_bytes = page_bytes(model_path, block) // block
    prompt_blocks = (args.prefix_tokens + QUESTION_TOKENS) // block + 1
    decoder_blocks = (DECODER_PROMPT_TOKENS + args.decode_tokens) // block + 1
    engine_blocks = args.engine_prompts * prompt_blocks + args.decoders * decoder_blocks + 2
    tier_gib = args.prefixes * prompt_blocks * block * token_bytes / 2**30 * 1.1
    tier = args.stall_tier
    mode = "async" if async_loads else "sync"
    engine = await start_engine(
        args,
        model_path,
        engine_blocks * block * token_bytes,
        {
            "policy": "lru",
            "cpu_tier_gib": tier_gib if tier == "cpu" else 0.0,
            "disk_tier_gib": tier_gib if tier == "disk" else 0.0,
            "disk_dir": str(disk_dir / f"stall-{mode}"),
            "async_loads": async_loads,
        },
        max_model_len=max(
            args.prefix_tokens + QUESTION_TOKENS, DECODER_PROMPT_TOKENS + args.decode_tokens
        )
        + 64,
    )
    rng = random.Random(1)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 8000) for _ in range(n))

    async def ask(request_id: str, prompt: tuple[int, ...], max_tokens: int) -> int:
        cached = 0
        sampling = SamplingSettings(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(EngineRequest(request_id, prompt, sampling)):
            cached = max(cached, chunk.num_cached_tokens)
        return cached

    prefixes = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
    try:
        started = time.perf_counter()
        for i, prefix in enumerate(prefixes):  # computed once: into the engine and the tier
            await ask(f"fill-{mode}-{i}", prefix + tokens(QUESTION_TOKENS), 1)
        recompute_ms = (time.perf_counter() - started) * 1e3 / len(prefixes)
        arrivals: list[list[tuple[float, int]]] = [[] for _ in range(args.decoders)]
        windows: list[tuple[float, float]] = []
        loads: list[float] = []
        cached: list[int] = []

        async def decode(index: int) -> None:
            request = EngineRequest(
                f"decode-{mode}-{index}",
                tokens(DECODER_PROMPT_TOKENS),
                SamplingSettings(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True),
            )
            async for chunk in engine.generate(request):
                arrivals[index].append((time.perf_counter(), len(chunk.token_ids)))

        decoders = [asyncio.create_task(decode(i)) for i in range(args.decoders)]
        await asyncio.sleep(LOAD_GAP_S)
        # The engine keeps the last few prefixes; the ones before them come from the tier.
        for i in range(len(prefixes) - args.engine_prompts):
            if all(task.done() for task in decoders):
                break
            if tier == "disk" and args.drop_caches:
                await asyncio.to_thread(drop_page_cache)
            start = time.perf_counter()
            hit = await ask(f"load-{mode}-{i}", prefixes[i] + tokens(QUESTION_TOKENS), 1)
            end = time.perf_counter()
            windows.append((start, end))
            loads.append((end - start) * 1e3)
            cached.append(hit)
            await asyncio.sleep(LOAD_GAP_S)
        await asyncio.gather(*decoders)
    finally:
        await engine.shutdown()
    during, idle = classify_steps(arrivals, windows)
    if not during or not idle:
        raise RuntimeError(
            f"no decode steps {'during' if not during else 'between'} loads: give the "
            "decoders more tokens (--decode-tokens) or fewer prefixes"
        )
    return StallResult(
        mode, tier, args.prefix_tokens, token_bytes, loads, cached, recompute_ms, during, idle
    )
