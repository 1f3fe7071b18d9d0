"""Engine profiles: the step-time formula and the two calibrated profiles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixmesh.replica.sim_model.profile import (
    CPU_SMALL,
    H100_LLAMA8B,
    EngineProfile,
    get_profile,
    with_cpu_tier,
)

TINY = EngineProfile(
    name="tiny",
    block_size=4,
    kv_blocks=16,
    max_batch_tokens=8,
    max_running=4,
    step_overhead_s=1.0,
    prefill_s_per_token=0.125,
    attn_s_per_token_ctx=0.01,
    decode_s_per_token=0.5,
    kv_read_s_per_ctx_token=0.001,
    weight_read_s=0.25,
    tp_efficiency=0.75,
)


def test_chunk_work_has_a_causal_attention_term() -> None:
    # 4 tokens after 6 of context: 4 * 0.125 + 4 * (6 + 2) * 0.01
    assert TINY.chunk_work_s(4, 6) == pytest.approx(0.5 + 0.32)


def test_decode_step_and_tensor_parallel_speedup() -> None:
    assert TINY.decode_step_s(3, 100) == pytest.approx(1.0 + 0.25 + 1.5 + 0.1)
    # tp=2 at 75% efficiency: GPU work / 1.5, host overhead unchanged
    assert TINY.decode_step_s(3, 100, tp_degree=2) == pytest.approx(1.0 + 1.85 / 1.5)
    assert TINY.tp_speedup(1) == 1.0 and TINY.tp_speedup(4) == 3.0
    assert TINY.kv_blocks_at(4) == 64
    with pytest.raises(ValueError):
        TINY.tp_speedup(0)


def test_idle_prefill_runs_in_budget_sized_chunks() -> None:
    # 12 tokens: 8 at context 0, then 4 at context 8; each step adds overhead and weight read
    expected = (1.0 + 0.25 + TINY.chunk_work_s(8, 0)) + (1.0 + 0.25 + TINY.chunk_work_s(4, 8))
    assert TINY.idle_prefill_s(12, 0) == pytest.approx(expected)
    assert TINY.full_prefill_step_s() == pytest.approx(1.25 + TINY.chunk_work_s(8, 0))
    assert TINY.prefill_tokens_per_s() == pytest.approx(8 / TINY.full_prefill_step_s())


def test_h100_llama8b_numbers_follow_from_public_figures() -> None:
    p = H100_LLAMA8B
    assert p.block_size == 16 and p.kv_blocks == 26_702  # 56 GB / (16 x 128 KiB)
    assert p.max_batch_tokens == 8192 and p.max_running == 1024
    assert p.prefill_s_per_token == pytest.approx(16.06e9 / (0.4 * 989e12))
    assert p.kv_read_s_per_ctx_token == pytest.approx(131072 / (0.8 * 3.35e12))
    assert 15_000 < p.prefill_tokens_per_s() < 30_000  # tokens/s of one H100 on an 8B model
    assert 0.006 < p.decode_step_s(1, 0) < 0.008  # ~7 ms per token at batch 1


def test_cpu_small_reproduces_the_measured_cold_prefill() -> None:
    p = CPU_SMALL
    assert p.kv_blocks == 4096 and p.block_size == 128  # 1 GiB at 2 KiB/token
    assert p.idle_prefill_s(2000, 0) == pytest.approx(0.0695)  # measured 69.5 ms
    assert p.idle_prefill_s(80, 1920) == pytest.approx(0.0107, abs=5e-4)  # measured 19.6 ms


def test_profiles_by_name_and_with_a_cpu_tier() -> None:
    assert get_profile("cpu-small") is CPU_SMALL
    with pytest.raises(ValueError):
        get_profile("nope")
    tiered = with_cpu_tier(H100_LLAMA8B, 100_000)
    assert tiered.cpu_blocks == 100_000
    assert tiered.cpu_load_s_per_block == H100_LLAMA8B.cpu_load_s_per_block


def test_profile_validation() -> None:
    with pytest.raises(ValueError):
        replace(TINY, max_running=9)  # more decodes than one step's token budget
    with pytest.raises(ValueError):
        replace(TINY, tp_efficiency=1.5)
