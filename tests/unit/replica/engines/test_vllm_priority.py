"""prefixmesh's vLLM scheduler (``replica/engines/vllm_priority.py``) on vLLM's own scheduler,
without an engine: a prefill in progress yields the next step to a more urgent request that can
start, not to an equal or less urgent one nor to one that has no slot, and the running requests
are served in priority order."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from prefixmesh.replica.demo_model import ensure_demo_model

BLOCK = 16
STEP_TOKENS = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(ensure_demo_model(tmp_path_factory.mktemp("models"), "tiny"))


def scheduler(model: str, max_num_seqs: int = 8, cls: Any = None) -> Any:
    """vLLM's choice for this config through prefixmesh's factory, or ``cls``."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from prefixmesh.replica.engines.vllm_priority import priority_ordered_scheduler

    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cache.num_gpu_blocks = 1_000
    config = VllmConfig(
        model_config=ModelConfig(model=model, tokenizer=model, max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=STEP_TOKENS,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            is_encoder_decoder=False,
            policy="priority",
        ),
        cache_config=cache,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=1_000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    return (cls or priority_ordered_scheduler)(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )


def request(request_id: str, tokens: int, priority: int, arrival: float) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=[(7 * i + priority) % 1000 + 3 for i in range(tokens)],
        sampling_params=SamplingParams(max_tokens=2),
        pooling_params=None,
        arrival_time=arrival,
        priority=priority,
    )


def steps(sched: Any, count: int) -> list[dict[str, int]]:
    return [dict(sched.schedule().num_scheduled_tokens) for _ in range(count)]


def test_a_prefill_in_progress_yields_the_next_step_to_a_more_urgent_request(model: str) -> None:
    sched = scheduler(model)
    sched.add_request(request("long", 1_000, priority=5, arrival=1.0))
    assert steps(sched, 1) == [{"long": STEP_TOKENS}]
    sched.add_request(request("urgent", 200, priority=0, arrival=2.0))
    # The urgent prompt gets the step whole; long's prefill goes on after it.
    assert steps(sched, 2) == [{"urgent": 200}, {"long": STEP_TOKENS}]
    # Its step gate is restored: nothing is left skipped.
    assert sched.requests["long"].next_decode_eligible_step == 0


def test_vllm_s_async_scheduler_yields_the_same(model: str) -> None:
    from prefixmesh.replica.engines.vllm_priority import (
        PriorityOrderedAsyncScheduler,
        PriorityOrderedScheduler,
    )

    assert type(scheduler(model)) is PriorityOrderedScheduler  # vLLM turns async off on CPU
    sched = scheduler(model, cls=PriorityOrderedAsyncScheduler)  # GPUs' default
    sched.add_request(request("long", 1_000, priority=5, arrival=1.0))
    steps(sched, 1)
    sched.add_request(request("urgent", 200, priority=0, arrival=2.0))
    # Async scheduling plans the urgent request's first decode at once, beside long's chunk.
    assert steps(sched, 2) == [{"urgent": 200}, {"urgent": 1, "long": STEP_TOKENS - 1}]


def test_an_equal_priority_waits_for_the_prefill_in_progress(model: str) -> None:
    sched = scheduler(model)
    sched.add_request(request("long", 600, priority=5, arrival=1.0))
    steps(sched, 1)
    sched.add_request(request("later", 200, priority=5, arrival=2.0))
    assert steps(sched, 2) == [{"long": STEP_TOKENS}, {"long": 88, "later": 168}]


def test_no_yield_to_a_request_without_a_free_slot(model: str) -> None:
    sched = scheduler(model, max_num_seqs=1)
    sched.add_request(request("long", 600, priority=5, arrival=1.0))
    steps(sched, 1)
    sched.add_request(request("urgent", 200, priority=0, arrival=2.0))
    assert steps(sched, 1) == [{"long": STEP_TOKENS}]


def test_running_prefills_share_the_step_most_urgent_first(model: str) -> None:
    sched = scheduler(model)
    sched.add_request(request("low", 1_000, priority=5, arrival=1.0))
    assert steps(sched, 1) == [{"low": STEP_TOKENS}]
    sched.add_request(request("high", 300, priority=1, arrival=2.0))
    # high takes the next step (low yields); both are then prefills in progress, low the
    # first to have started, and the step's budget goes to high's rest first.
    assert steps(sched, 2) == [{"high": STEP_TOKENS}, {"high": 44, "low": 212}]
