"""The oracle (one unbounded cache in arrival order) and the offered-work model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixmesh.loadtest.keys import KeyBuilder, Segment
from prefixmesh.loadtest.oracle import (
    fleet_capacity,
    offered_work_s,
    oracle_hits,
    ttft_floor_s,
    work_model,
)
from prefixmesh.loadtest.workloads import make_request
from prefixmesh.replica.sim_model.profile import EngineProfile

TINY = EngineProfile(
    name="tiny",
    block_size=16,
    kv_blocks=64,
    max_batch_tokens=32,
    max_running=4,
    step_overhead_s=1.0,
    prefill_s_per_token=0.125,
    attn_s_per_token_ctx=0.0,
    decode_s_per_token=0.5,
    kv_read_s_per_ctx_token=0.0,
    tp_efficiency=1.0,
)

X, Y, Z = Segment(1, 32), Segment(2, 16), Segment(3, 16)


def hand_built() -> list:
    return [
        make_request("b", 1.0, (X, Y), 4),  # after a: hits x
        make_request("a", 0.0, (X,), 4),
        make_request("c", 2.0, (X,), 4),  # block-aligned repeat: the last block is computed
        make_request("d", 3.0, (Z,), 4),
    ]


def test_oracle_hits_leading_blocks_in_arrival_order() -> None:
    oracle = oracle_hits(hand_built(), KeyBuilder(16))
    assert oracle.hit_tokens == {"a": 0, "b": 32, "c": 16, "d": 0}
    assert oracle.prompt_tokens == 32 + 48 + 32 + 16
    assert oracle.hit_rate == pytest.approx(48 / 128)
    assert oracle.miss_tokens == 80


def test_oracle_counts_a_cached_answer_for_the_next_turn() -> None:
    answer = Segment(9, 16)
    turn1 = make_request("t1", 0.0, (X,), 16, finish_segments=(X, answer))
    turn2 = make_request("t2", 5.0, (X, answer, Z), 4, follows="t1", think_s=1.0)
    assert oracle_hits([turn1, turn2], KeyBuilder(16)).hit_tokens["t2"] == 48


def test_work_model_counts_missed_prefill_and_decode() -> None:
    requests = hand_built()
    model = work_model(TINY, requests)
    # mean reservation: (3 + 4 + 3 + 2) / 4 = 3 blocks -> 21 fit, capped by max_running
    assert model.saturation_batch == 4
    assert model.decode_s_per_token == pytest.approx((1.0 + 4 * 0.5) / 4)
    # 16 missed tokens: a full step's overhead shared by 32 tokens, plus their GEMM time
    assert model.prefill_s(16, 32) == pytest.approx(16 / 32 + 16 * 0.125)
    assert model.request_s(48, 32, 4) == pytest.approx(model.prefill_s(16, 32) + 3 * 0.75)
    oracle = oracle_hits(requests, KeyBuilder(16))
    total = offered_work_s(requests, oracle, model)
    assert total == pytest.approx(
        sum(model.request_s(r.prompt_tokens, oracle.hit_tokens[r.request_id], 4) for r in requests)
    )


def test_fleet_capacity_counts_tensor_parallel_replicas_by_speed() -> None:
    assert fleet_capacity(TINY, (1, 1)) == pytest.approx(2.0)
    # tp=2 at full efficiency halves the GPU part of a full step (1 + 4) -> (1 + 2)
    assert fleet_capacity(TINY, (2,)) == pytest.approx(5.0 / 3.0)


def test_ttft_floor_is_the_idle_prefill_of_what_the_oracle_misses() -> None:
    requests = hand_built()
    oracle = oracle_hits(requests, KeyBuilder(16))
    # a: 32 tokens (one step: 1 + 4); b: 16 (1 + 2); c: 16 (1 + 2); d: 16 (1 + 2)
    assert ttft_floor_s(requests, oracle, TINY) == pytest.approx((5 + 3 + 3 + 3) / 4)
    faster = ttft_floor_s(requests, oracle, replace(TINY, step_overhead_s=0.0))
    assert faster == pytest.approx((4 + 2 + 2 + 2) / 4)
