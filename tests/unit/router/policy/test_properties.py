"""Whatever snapshots and views a policy is given, it returns a usable ranking."""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixmesh.cache_registry.types import BlockHash, PrefixHit, PrefixKey, ReplicaId
from prefixmesh.config import RoutingConfig
from prefixmesh.router.policy import POLICY_NAMES, make_policy
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaCapacity,
    ReplicaSnapshot,
    RouteRequest,
)

BLOCK_SIZE = 4
REPLICA_POOL = [ReplicaId(f"r{i}") for i in range(12)]

counts = st.integers(min_value=0, max_value=400)
capacities = st.builds(
    ReplicaCapacity,
    prefill_tokens_per_s=st.sampled_from([0.0, 1.0, 500.0, 1000.0, 1e7]),
    decode_step_s=st.sampled_from([0.0, 0.005, 0.05, 2.0]),
    max_batch_tokens=st.sampled_from([0, 1, 16, 2048]),
    kv_blocks=st.integers(min_value=0, max_value=1000),
    tp_degree=st.sampled_from([1, 2, 4]),
    cpu_load_s_per_block=st.sampled_from([0.0, 0.001]),
    disk_load_s_per_block=st.sampled_from([0.0, 0.01]),
)


@st.composite
def fleets(draw: st.DrawFn) -> list[ReplicaSnapshot]:
    names = draw(st.lists(st.sampled_from(REPLICA_POOL), min_size=1, max_size=8, unique=True))
    return [
        ReplicaSnapshot(
            name,
            draw(capacities),
            queued_requests=draw(counts),
            running_requests=draw(counts),
            pending_prefill_tokens=draw(st.integers(min_value=0, max_value=100_000)),
            active_kv_blocks=draw(counts),
        )
        for name in names
    ]


@st.composite
def requests(draw: st.DrawFn) -> RouteRequest:
    blocks = draw(st.lists(st.integers(min_value=0, max_value=3), max_size=10))
    hashes = tuple(BlockHash(hash(tuple(blocks[: i + 1])) & 0xFFFF) for i in range(len(blocks)))
    extra = draw(st.integers(min_value=0, max_value=BLOCK_SIZE - 1))
    return RouteRequest(
        request_id=draw(st.sampled_from(["x", "y"])),
        key=PrefixKey(hashes, BLOCK_SIZE),
        prompt_tokens=len(blocks) * BLOCK_SIZE + extra,
        output_tokens=draw(st.integers(min_value=0, max_value=500)),
    )


@st.composite
def hits(draw: st.DrawFn) -> PrefixHit:
    gpu, cpu, disk = (draw(st.integers(min_value=0, max_value=12)) for _ in range(3))
    speculative = draw(st.integers(min_value=0, max_value=gpu))
    return PrefixHit(gpu + cpu + disk, (gpu, cpu, disk), speculative)


views = st.builds(
    RegistryView,
    hits=st.dictionaries(st.sampled_from(REPLICA_POOL), hits(), max_size=6),
    group_rate=st.one_of(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.just(math.inf)),
)

steps = st.lists(st.tuples(fleets(), requests(), views), min_size=1, max_size=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps, seed=st.integers(min_value=0, max_value=3))
def test_every_policy_always_ranks_a_subset_of_the_replicas(
    steps: list[tuple[list[ReplicaSnapshot], RouteRequest, RegistryView]], seed: int
) -> None:
    for name in POLICY_NAMES:  # one drawn scenario, every policy
        run_policy(name, steps, seed)


def run_policy(
    name: str, steps: list[tuple[list[ReplicaSnapshot], RouteRequest, RegistryView]], seed: int
) -> None:
    policy = make_policy(name, RoutingConfig(), rng=random.Random(seed), block_size=BLOCK_SIZE)
    for now_s, (replicas, request, view) in enumerate(steps):
        decision = policy.route(request, replicas, view, float(now_s))
        ranked = [replica for tier in decision.ranked for replica in tier]
        assert ranked and all(decision.ranked), name
        assert len(set(ranked)) == len(ranked), name
        assert set(ranked) <= {snapshot.replica_id for snapshot in replicas}, name
        if decision.hold is not None:
            assert decision.hold.num_blocks >= 1
            assert 0 <= decision.hold.max_wait_s < math.inf
        weight = policy.traffic_weight(request)
        assert 0 <= weight < math.inf, name
        policy.prefix_group(request)
        policy.on_routed(request, decision.chosen, float(now_s))
        policy.on_finished(request, decision.chosen, float(now_s))
        if now_s % 3 == 2:
            policy.on_replica_removed(replicas[-1].replica_id)
