from __future__ import annotations

import random

import pytest

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.policy.base import ReplicaCapacity
from prefixmesh.router.policy.ttft import TtftModel, step_times
from tests.unit.router.policy.builders import CAPACITY, hit, request, snap


def model(**overrides: float) -> TtftModel:
    settings = {
        "block_size": 4,
        "min_prefill_share": 0.05,
        "cpu_fallback_credit": 0.75,
        "disk_fallback_credit": 0.25,
        "queue_externality": 1.0,
    } | overrides
    return TtftModel(**settings)  # type: ignore[arg-type]


def test_prefill_shares_each_step_with_the_running_decodes() -> None:
    # 1 ms per token, 10 ms fixed per step, budget 100 tokens.
    idle = step_times(CAPACITY, 0, 0, 0.05)
    assert (idle.token_s, idle.decode_step_s, idle.prefill_chunk_tokens) == (0.001, 0.01, 100)
    assert idle.prefill_s_per_token == pytest.approx(0.11 / 100)
    busy = step_times(CAPACITY, 20, 0, 0.05)  # 20 decode tokens per step: 80 left to prefill
    assert busy.decode_step_s == pytest.approx(0.03)
    assert busy.prefill_s_per_token == pytest.approx(0.11 / 80)
    swamped = step_times(CAPACITY, 500, 0, 0.05)  # the chunk floor: 5 tokens a step
    assert swamped.prefill_s_per_token == pytest.approx((0.51 + 0.005) / 5)
    # Reading the running requests' KV (100 blocks x 0.1 ms) lengthens every step.
    reading = ReplicaCapacity(1000.0, 0.01, 100, 1000, kv_read_s_per_block=0.0001)
    assert step_times(reading, 20, 100, 0.05).decode_step_s == pytest.approx(0.04)


def test_ttft_is_queue_plus_uncached_prefill_plus_lower_tier_loads() -> None:
    capacity = ReplicaCapacity(1000.0, 0.01, 100, 1000, cpu_load_s_per_block=0.001)
    replica = snap("a", running=20, pending=200, capacity=capacity)
    per_token = 0.11 / 80
    # 10 blocks; GPU 4 + CPU 2 (loaded, 1 ms each) + disk 2 (no load time: credit 0.25)
    # -> saved 6.5 blocks = 26 tokens, 14 to compute.
    estimate = model().explain(request(*range(10)), replica, hit(gpu=4, cpu=2, disk=2))
    # Half of a 30 ms decode step, then the 200 tokens queued there.
    assert estimate.queue_wait_s == pytest.approx(0.015 + 200 * per_token)
    assert estimate.uncached_tokens == 14
    assert estimate.prefill_s == pytest.approx(0.03 + 0.014)  # one step carries all 14
    assert estimate.load_s == pytest.approx(0.002)
    assert estimate.ttft_s == pytest.approx(0.015 + 200 * per_token + 0.044 + 0.002)
    assert estimate.work_s == pytest.approx(0.014)  # 14 tokens at 1 ms
    long_prompt = model().explain(request(*range(100)), replica, None)  # 400 tokens: 5 steps
    assert long_prompt.prefill_s == pytest.approx(400 * per_token)


def test_a_long_prompt_adds_the_attention_its_prefill_rate_does_not_count() -> None:
    # 1 us per query-key pair; the rate's 100-token chunks at zero context count 50 a token.
    capacity = ReplicaCapacity(1000.0, 0.01, 100, 1000, attn_s_per_token_pair=1e-6)
    # The last 300 of 1,000 tokens attend to 300 x (1000 - 150) pairs, 300 x 50 of them counted.
    assert capacity.prefill_attention_s(1000, 300) == pytest.approx(300 * 800 * 1e-6)
    assert capacity.prefill_attention_s(80, 80) == 0.0  # within one chunk: the rate counts it all
    assert CAPACITY.prefill_attention_s(1000, 300) == 0.0  # not reported: linear
    linear = model().explain(request(*range(250)), snap("a"), None)  # 1,000 tokens
    quadratic = model().explain(request(*range(250)), snap("a", capacity=capacity), None)
    extra = 1000 * (500 - 50) * 1e-6
    assert quadratic.prefill_s == pytest.approx(linear.prefill_s + extra)
    assert quadratic.work_s == pytest.approx(linear.work_s + extra)


def test_the_queue_wait_adds_the_attention_of_the_prompts_the_replica_still_computes() -> None:
    # The replica reports 0.5 s of attention in what it has still to prefill (a long prompt
    # it is deep in): its queue lasts that much longer than its 200 tokens say.
    linear = model().explain(request(1), snap("a", pending=200), None)
    busy = model().explain(request(1), snap("a", pending=200, pending_attention_s=0.5), None)
    assert busy.queue_wait_s == pytest.approx(linear.queue_wait_s + 0.5)
    assert busy.ttft_s == pytest.approx(linear.ttft_s + 0.5)
    # Nothing pending: a stale attention figure adds nothing.
    idle = model().explain(request(1), snap("a", pending_attention_s=0.5), None)
    assert idle.queue_wait_s == 0.0


def test_waits_on_idle_and_decoding_replicas() -> None:
    assert model().explain(request(1), snap("a"), None).queue_wait_s == 0.0
    decoding = model().explain(request(1), snap("a", running=20), None)
    assert decoding.queue_wait_s == pytest.approx(0.015)  # half a 30 ms decode step
    light = model().explain(request(1), snap("a", pending=20), None)
    assert light.queue_wait_s == pytest.approx(0.005 + 20 * 0.0011)


def test_first_token_takes_at_least_one_step_and_the_last_token_is_computed() -> None:
    estimate = model().explain(request(1, 2), snap("a"), hit(gpu=2))
    assert estimate.uncached_tokens == 1
    assert estimate.prefill_s == pytest.approx(0.011)


def test_a_hit_longer_than_the_prompt_is_trimmed_from_its_deepest_tier() -> None:
    estimate = model().explain(request(1, 2), snap("a"), hit(gpu=1, cpu=1, disk=3))
    # 2 prompt blocks: GPU 1 + CPU 1 kept (CPU credit 0.75 without a load time).
    assert estimate.uncached_tokens == round(8 - 1.75 * 4)


def test_bulk_estimate_matches_the_term_by_term_one() -> None:
    rng = random.Random(3)
    tiny = model()
    for _ in range(80):
        tiny.running_cost = rng.choice([1.0, 3.5])
        capacities = [
            ReplicaCapacity(
                rng.choice([500.0, 1000.0, 2000.0, 1e6]),
                rng.choice([0.0, 0.01, 0.2]),
                rng.choice([16, 100, 2048]),
                100,
                cpu_load_s_per_block=rng.choice([0.0, 0.002]),
                shared_load_s_per_block=rng.choice([0.0, 0.0005, 0.5]),
                kv_read_s_per_block=rng.choice([0.0, 1e-5]),
                attn_s_per_token_pair=rng.choice([0.0, 0.0, 1e-6]),
            )
            for _ in range(6)
        ]
        replicas = [
            snap(
                f"r{i}",
                running=rng.randrange(40),
                pending=rng.choice([0, rng.randrange(500)]),
                queued=rng.choice([0, 0, rng.randrange(5)]),
                kv=rng.randrange(300),
                capacity=c,
                pending_attention_s=rng.choice([0.0, 0.0, rng.random()]),
            )
            for i, c in enumerate(capacities)
        ]
        req = request(*range(rng.randrange(1, 40)), extra_tokens=rng.randrange(4))
        hits = {
            ReplicaId(f"r{i}"): hit(
                gpu=rng.randrange(30),
                cpu=rng.randrange(3),
                disk=rng.choice([0, 0, 1]),
                speculative=0,
            )
            for i in rng.sample(range(6), 3)
        }
        # A registry hands replicas with equal rows one shared PrefixHit (estimate reuses
        # the work for an all-GPU one, and must not for one whose CPU blocks load differently).
        shared = hit(gpu=rng.randrange(1, 30), cpu=rng.choice([0, 0, 2]))
        for i in rng.sample(range(6), rng.randrange(4)):
            hits[ReplicaId(f"r{i}")] = shared
        shared_blocks = rng.choice([0, rng.randrange(40)])
        bulk = tiny.estimate(req, replicas, hits, work_price=0.5, shared_blocks=shared_blocks)
        for i, replica in enumerate(replicas):
            one = tiny.explain(req, replica, hits.get(replica.replica_id), shared_blocks)
            assert bulk.queue_wait_s[i] == pytest.approx(one.queue_wait_s)
            assert bulk.cost[i] == pytest.approx(one.cost(0.5, 1.0))
        backlogs = [
            s.pending_prefill_tokens * tiny.explain(req, s, None).steps.prefill_s_per_token
            + (s.pending_attention_s if s.pending_prefill_tokens > 0 else 0.0)
            for s in replicas
        ]
        assert bulk.least_backlog_s == pytest.approx(min(backlogs))
        for index, held, uncached in bulk.holders:
            one = tiny.explain(req, replicas[index], held)
            assert uncached == one.uncached_tokens
            assert tiny.per_token_s(replicas[index]) == pytest.approx(one.steps.prefill_s_per_token)


def test_a_replica_loads_from_the_shared_tier_what_it_does_not_hold() -> None:
    fast = ReplicaCapacity(1000.0, 0.01, 100, 1000, shared_load_s_per_block=0.0005)
    slow = ReplicaCapacity(1000.0, 0.01, 100, 1000, shared_load_s_per_block=0.01)
    req = request(*range(10))  # 40 tokens; a block prefills in 4 ms
    # The shared tier holds 8 blocks, the replica itself 3 in GPU memory: 5 come from the
    # shared tier (0.5 ms each), 8 tokens are computed.
    held = model().explain(req, snap("a", capacity=fast), hit(gpu=3), shared_blocks=8)
    assert (held.uncached_tokens, held.load_s) == (8, pytest.approx(0.0025))
    # Reading a block slower than computing it: the shared tier is not used.
    plain = model().explain(req, snap("a", capacity=slow), hit(gpu=3), shared_blocks=8)
    assert (plain.uncached_tokens, plain.load_s) == (28, 0.0)
    # A replica that reports no shared-tier cost reads none.
    assert model().explain(req, snap("a"), None, shared_blocks=8).uncached_tokens == 40


def test_terms_kept_across_calls_follow_every_changed_snapshot() -> None:
    # One model reused over a fleet whose snapshots are replaced a few at a time (as adapters
    # do) must estimate exactly what a fresh model does, including after the running cost,
    # the fleet or its order change.
    rng = random.Random(11)
    kept = model()
    fleet = [snap(f"r{i}", running=rng.randrange(40), pending=rng.randrange(300)) for i in range(8)]
    for step in range(60):
        for position in rng.sample(range(len(fleet)), rng.randrange(3)):
            fleet[position] = snap(
                fleet[position].replica_id,
                running=rng.randrange(40),
                pending=rng.choice([0, rng.randrange(300)]),
                queued=rng.randrange(3),
            )
        if step % 20 == 7:
            kept.running_cost = rng.choice([1.0, 2.5])
        if step == 30:
            fleet.reverse()
        if step == 45:
            fleet.append(snap("new", running=3))
        req = request(*range(rng.randrange(1, 30)))
        hits = {fleet[1].replica_id: hit(gpu=rng.randrange(1, 20))}
        fresh = model()
        fresh.running_cost = kept.running_cost
        got = kept.estimate(req, list(fleet), hits, work_price=0.3, credit=((2,), 5))
        want = fresh.estimate(req, list(fleet), hits, work_price=0.3, credit=((2,), 5))
        assert got == want


def test_a_long_prompt_avoids_a_replica_where_short_requests_wait_to_start() -> None:
    # Both idle but for their queues: a has 3 requests about to start, b none. The 90-token
    # prompt's first chunk would delay each of a's by 90 ms.
    replicas = [snap("a", queued=3, pending=3), snap("b", running=1)]
    estimates = model().estimate(request(*range(22), extra_tokens=2), replicas, {})
    one = model().explain(request(*range(22), extra_tokens=2), replicas[0], None)
    assert (one.waiting_requests, one.delay_s) == (3, pytest.approx(0.09))
    assert estimates.cost[0] == pytest.approx(one.ttft_s + 3 * 0.09)
    assert estimates.cost[1] < estimates.cost[0]
    # A running prefill with nothing queued counts as one waiting request.
    assert model().explain(request(1), snap("a", pending=50), None).waiting_requests == 1


def test_the_learned_running_cost_lengthens_a_busy_replica_s_steps() -> None:
    tiny = model()
    busy = snap("a", running=20)
    plain = tiny.explain(request(1), busy, None).steps.decode_step_s
    tiny.running_cost = 3.0
    assert tiny.explain(request(1), busy, None).steps.decode_step_s == pytest.approx(
        plain + 2 * 20 * 0.001
    )


def test_zero_rates_in_a_report_do_not_divide_by_zero() -> None:
    broken = [
        snap("a", pending=10, capacity=ReplicaCapacity(0.0, 0.0, 0, 0)),
        snap("b", pending=10, capacity=CAPACITY),
        snap("c", pending=10, capacity=ReplicaCapacity(float("inf"), 0.0, 16, 0)),
    ]
    estimates = model().estimate(request(1, 2), broken, {})
    assert estimates.cost[0] > estimates.cost[1]
