"""Simulator invariants: everything finishes, work is conserved, runs repeat exactly."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Hashable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from prefixmesh.cache_registry.types import SHARED_TIER, BlockHash
from prefixmesh.config import RoutingConfig
from prefixmesh.loadtest.cluster_sim import ClusterSim, SimConfig, SimResult
from prefixmesh.loadtest.keys import KeyBuilder, Segment
from prefixmesh.loadtest.metrics import compute_metrics
from prefixmesh.loadtest.oracle import oracle_hits
from prefixmesh.loadtest.workloads import (
    BlogWorkload,
    BurstWorkload,
    GroupsWorkload,
    MultiturnWorkload,
    WorkloadRequest,
    make_request,
)
from prefixmesh.replica.kvcache.policy import Clock, LRUPolicy, TierPolicy
from prefixmesh.replica.sim_model.profile import H100_LLAMA8B, with_cpu_tier, with_shared_tier
from prefixmesh.router.policy import make_policy
from prefixmesh.router.policy.base import registry_view
from tests.unit.loadtest.policies import LongestHit, RoundRobin

PROFILE = replace(H100_LLAMA8B, kv_blocks=2048)  # small caches: evictions happen


def run(
    requests: list[WorkloadRequest], policy: object, replicas: int = 4, **options: object
) -> SimResult:
    config = SimConfig.uniform(PROFILE, replicas, **options)  # type: ignore[arg-type]
    return ClusterSim(config, policy).run(requests)  # type: ignore[arg-type]


def blog(count: int = 300, rate: float = 40.0) -> list[WorkloadRequest]:
    return BlogWorkload(system_prompt_tokens=8192).generate(count, rate, seed=7)


@pytest.mark.parametrize("policy", [RoundRobin, LongestHit])
def test_every_request_finishes_and_work_is_conserved(policy: type) -> None:
    requests = blog()
    result = run(requests, policy())
    assert len(result.outcomes) == len(requests)
    for outcome in result.outcomes:
        record = outcome.record
        assert record.prefill_tokens + record.cached_tokens == record.prompt_tokens
        assert record.arrival_s <= record.admitted_s <= record.first_token_s <= record.finish_s
        assert not record.aborted
    oracle = oracle_hits(requests, KeyBuilder(PROFILE.block_size))
    metrics = compute_metrics(result, oracle)
    assert metrics.requests == len(requests)
    assert 0 < metrics.hit_rate <= metrics.oracle_hit_rate
    assert metrics.redundant_prefill_tokens >= 0
    assert metrics.ttft_p50_s <= metrics.ttft_p99_s and metrics.load_imbalance >= 1.0


def test_same_inputs_same_results() -> None:
    requests = blog()
    first = run(requests, LongestHit())
    second = run(requests, LongestHit())
    assert [o.record for o in first.outcomes] == [o.record for o in second.outcomes]
    assert first.busy_s == second.busy_s and first.events == second.events


def test_one_big_replica_with_spaced_arrivals_reaches_the_oracle() -> None:
    x, y, z = Segment(1, 64), Segment(2, 32), Segment(3, 16)
    requests = [
        make_request("a", 0.0, (x,), 2),
        make_request("b", 10.0, (x, y), 2),
        make_request("c", 20.0, (x, y, z), 2),
        make_request("d", 30.0, (z,), 2),
        make_request("e", 40.0, (x,), 2),
    ]
    oracle = oracle_hits(requests, KeyBuilder(16))
    result = run(requests, RoundRobin(), replicas=1)
    cached = {o.record.request_id: o.record.cached_tokens for o in result.outcomes}
    assert cached == oracle.hit_tokens == {"a": 0, "b": 64, "c": 96, "d": 0, "e": 48}
    assert compute_metrics(result, oracle).hit_rate == oracle.hit_rate


def test_registry_sees_every_event_in_sequence() -> None:
    sim = ClusterSim(SimConfig.uniform(PROFILE, 3, registry_lag_s=0.01), LongestHit())
    sim.run(blog(100))
    for replica in sim.replicas:
        assert sim.registry.sequences[replica.replica_id].seq == replica.seq - 1
    held = {
        r.replica_id: len(sim.registry.replica_blocks.get(r.replica_id, ())) for r in sim.replicas
    }
    assert held == {r.replica_id: r.engine.cache.num_cached for r in sim.replicas}


def test_holds_turn_a_burst_into_hits() -> None:
    requests = BurstWorkload(burst_size=8, prefix_tokens=8192).generate(64, rate=2.0, seed=1)
    oracle = oracle_hits(requests, KeyBuilder(PROFILE.block_size))
    plain = compute_metrics(run(requests, LongestHit(), registry_lag_s=0.05), oracle)
    held = compute_metrics(run(requests, LongestHit(hold_s=2.0), registry_lag_s=0.05), oracle)
    assert held.held_requests > 0
    assert held.redundant_prefill_tokens < plain.redundant_prefill_tokens
    assert held.hit_rate > plain.hit_rate


def test_follow_up_turns_arrive_after_their_parent_finishes() -> None:
    requests = MultiturnWorkload().generate(60, rate=4.0, seed=3)
    result = run(requests, LongestHit())
    finished = {o.record.request_id: o.record for o in result.outcomes}
    for request in requests:
        if request.follows is not None:
            parent = finished[request.follows]
            assert finished[request.request_id].arrival_s == pytest.approx(
                parent.finish_s + request.think_s
            )
    follow_ups = [finished[r.request_id] for r in requests if r.follows is not None]
    assert sum(r.cached_tokens for r in follow_ups) > 0.5 * sum(r.prompt_tokens for r in follow_ups)


class Recorder:
    """A ``RequestQueue`` that records what a CPU tier's policy hears."""

    def __init__(self) -> None:
        self.waited: list[Hashable] = []
        self.ran: list[Hashable] = []

    def queued(self, request_id: Hashable, blocks: Sequence[BlockHash]) -> None:
        self.waited.append(request_id)

    def started(self, request_id: Hashable) -> None:
        self.ran.append(request_id)


def test_each_replica_runs_its_own_cpu_tier_policy_and_hears_its_waiting_requests() -> None:
    made: list[tuple[LRUPolicy, Recorder]] = []

    def make(clock: Clock) -> TierPolicy:
        policy, recorder = LRUPolicy(), Recorder()
        made.append((policy, recorder))
        return TierPolicy(policy, recorder)

    profile = with_cpu_tier(replace(PROFILE, kv_blocks=1200), 4096)  # evictions: CPU hits
    config = SimConfig.uniform(profile, 2, cpu_policy=make)
    sim = ClusterSim(config, LongestHit())
    groups = GroupsWorkload(num_groups=32, system_prompt_tokens=2048)  # 4,096 blocks of prefixes
    result = sim.run(groups.generate(300, 40.0, seed=3))
    assert [replica.engine.cache.cpu.policy for replica in sim.replicas] == [p for p, _ in made]
    served = [
        sorted(o.record.request_id for o in result.outcomes if o.replica == i) for i in (0, 1)
    ]
    for (_, recorder), ids in zip(made, served, strict=True):
        assert sorted(recorder.waited) == ids  # every request it served waited there first
        assert sorted(recorder.ran) == ids  # and left the queue when it ran
    assert sum(o.record.cpu_cached_tokens for o in result.outcomes) > 0


def test_mixed_tensor_parallel_fleet() -> None:
    config = SimConfig(PROFILE, (1, 2, 4))
    result = ClusterSim(config, RoundRobin()).run(blog(90))
    assert len(result.outcomes) == 90
    assert result.busy_s[2] < result.busy_s[0]  # same requests, faster replica


_DIGEST_SCRIPT = """
from dataclasses import replace
from prefixmesh.loadtest.cluster_sim import ClusterSim, SimConfig
from prefixmesh.loadtest.workloads import BlogWorkload
from prefixmesh.cache_registry.types import SHARED_TIER
from prefixmesh.replica.sim_model.profile import H100_LLAMA8B, with_shared_tier
from prefixmesh.router.policy.base import registry_view
from tests.unit.loadtest.policies import LongestHit
requests = BlogWorkload(system_prompt_tokens=8192).generate(200, 40.0, seed=7)
config = SimConfig.uniform(replace(H100_LLAMA8B, kv_blocks=2048), 4)
result = ClusterSim(config, LongestHit()).run(requests)
print([(o.replica, o.record.first_token_s, o.record.cached_tokens) for o in result.outcomes])
"""


def test_results_do_not_depend_on_string_hash_seeds() -> None:
    """Same inputs in another process (another PYTHONHASHSEED) give the same run."""
    root = Path(__file__).resolve().parents[3]
    outputs = [
        subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) > 1000


def test_a_shared_tier_serves_one_replicas_prefix_to_another() -> None:
    x = Segment(1, 64)
    requests = [make_request("a", 0.0, (x,), 2), make_request("b", 10.0, (x,), 2)]
    profile = with_shared_tier(PROFILE, 10e9)
    config = SimConfig.uniform(profile, 2, registry_lag_s=0.0, shared_blocks=100)
    sim = ClusterSim(config, RoundRobin())  # b goes to the replica that never saw x
    result = sim.run(requests)
    records = {o.record.request_id: o.record for o in result.outcomes}
    assert {o.record.request_id: o.replica for o in result.outcomes} == {"a": 0, "b": 1}
    assert (records["b"].cached_tokens, records["b"].shared_cached_tokens) == (48, 48)
    assert records["a"].shared_cached_tokens == 0
    # The registry knows the shared tier once, as its own holder, not per replica.
    key = KeyBuilder(16).key((x,))
    hits = sim.registry.lookup(key, ())
    assert hits[SHARED_TIER].num_blocks == 4
    assert registry_view(hits).shared_blocks == 4
    assert SHARED_TIER not in registry_view(hits).hits


def test_siblings_of_a_long_prefill_wait_for_it_past_the_entries_base_lifetime() -> None:
    # Regression (the Mooncake trace, 2026-11-29): a 191k-token prompt prefills in 32 s on an
    # H100, three quarters of it attention; the router estimated it linear (9 s) and its
    # routing-time registry entries lived 2 s, so the siblings that came meanwhile recomputed
    # the whole prompt elsewhere, 32 s each, instead of waiting for it.
    long = Segment(1, 120_000)
    requests = [
        make_request(name, arrival_s, (long, Segment(question, 64)), 2)
        for name, arrival_s, question in (("first", 0.0, 2), ("second", 5.0, 3), ("third", 10.0, 4))
    ]
    config = SimConfig.uniform(H100_LLAMA8B, 2, registry_lag_s=0.05)
    policy = make_policy(
        "prefixmesh", RoutingConfig(), rng=random.Random(0), block_size=H100_LLAMA8B.block_size
    )
    outcomes = {o.record.request_id: o for o in ClusterSim(config, policy).run(requests).outcomes}
    first = outcomes["first"]
    # The siblings come after the entries' base lifetime and before the prompt is computed.
    assert first.record.first_token_s > 10.0 + config.speculative_ttl_s
    for name in ("second", "third"):
        sibling = outcomes[name]
        assert sibling.held and sibling.replica == first.replica
        assert sibling.record.cached_tokens == 120_000


def test_a_request_avoids_a_holder_deep_in_a_long_prompt_that_its_report_prices_in_full() -> None:
    # Regression (the queue-wait half of the Mooncake finding): replicas reported the prompt
    # tokens they still had to compute, and the router priced them linear, so a replica deep
    # in a long prompt's most attention-heavy chunks looked a few seconds from free when it was
    # many. "x" holds 66k tokens there; recomputing them on the idle replica is faster.
    shared = Segment(5, 66_000)
    requests = [
        make_request("warm", 0.0, (shared, Segment(6, 64)), 2),
        # Hits warm's 66k, then computes 54k more at 66k-120k of context.
        make_request("long", 6.0, (shared, Segment(1, 54_000)), 2),
        make_request("x", 8.0, (shared, Segment(9, 64)), 2),
    ]
    config = SimConfig.uniform(H100_LLAMA8B, 2, registry_lag_s=0.05)
    policy = make_policy(
        "prefixmesh", RoutingConfig(), rng=random.Random(0), block_size=H100_LLAMA8B.block_size
    )
    outcomes = {o.record.request_id: o for o in ClusterSim(config, policy).run(requests).outcomes}
    long, x = outcomes["long"], outcomes["x"]
    assert long.replica == outcomes["warm"].replica and long.record.cached_tokens >= 65_000
    assert x.replica != long.replica and x.record.cached_tokens == 0
    assert x.record.first_token_s < long.record.first_token_s
