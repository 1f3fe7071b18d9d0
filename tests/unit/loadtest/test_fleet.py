"""What simulated replicas tell the router: capacity consistent with the step model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixmesh.loadtest.fleet import SimReplica, capacity
from prefixmesh.replica.sim_model.profile import H100_LLAMA8B, with_cpu_tier


def test_capacity_follows_the_step_model_and_scales_with_tp() -> None:
    p = H100_LLAMA8B
    one = capacity(p)
    assert one.prefill_tokens_per_s == pytest.approx(8192 / p.full_prefill_step_s())
    assert one.decode_step_s == pytest.approx(
        p.step_overhead_s + p.weight_read_s + p.decode_s_per_token
    )
    assert (one.kv_blocks, one.tp_degree, one.cpu_load_s_per_block) == (26_702, 1, 0.0)
    four = capacity(p, 4)
    assert four.kv_blocks == 4 * one.kv_blocks and four.tp_degree == 4
    # GPU work runs 4 x 0.85 = 3.4 times as fast; the 1 ms host overhead does not shrink
    gpu_s = p.full_prefill_step_s() - p.step_overhead_s
    assert four.prefill_tokens_per_s == pytest.approx(8192 / (p.step_overhead_s + gpu_s / 3.4))
    assert 3.0 < four.prefill_tokens_per_s / one.prefill_tokens_per_s < 3.4
    tiered = capacity(with_cpu_tier(p, 1000), 2)
    assert tiered.cpu_load_s_per_block == pytest.approx(p.cpu_load_s_per_block / 1.7)
    assert four.attn_s_per_token_pair == pytest.approx(p.attn_s_per_token_ctx / 3.4)


def test_the_router_s_estimate_of_a_long_prefill_is_the_step_model_s() -> None:
    # The rate alone says 28% of a 191k-token prefill; with the attention it does not count,
    # the router's estimate is the engine model's (within 0.2% from 50k tokens up).
    one = capacity(H100_LLAMA8B)
    for tokens in (8192, 50_000, 191_374):
        estimate = tokens / one.prefill_tokens_per_s + one.prefill_attention_s(tokens, tokens)
        assert estimate == pytest.approx(H100_LLAMA8B.idle_prefill_s(tokens, 0), rel=2e-3)


def test_snapshots_are_rebuilt_only_when_the_engine_changed() -> None:
    replica = SimReplica(3, replace(H100_LLAMA8B, kv_blocks=100))
    first = replica.snapshot()
    assert first.replica_id == "replica-3" and first.ongoing_requests == 0
    assert replica.snapshot() is first
