"""Several ingresses route consistently (issue 6, D3): two routing cores with different random
seeds on one Redis registry, four fake replicas whose reports are frozen (as if every report
lagged). Same prefix, same holder (or the same hot group members) from either router; no pile-up
between reports; a router created after the events routes on them at its first decision.

The lookup deadline is raised to 100 ms: on a loaded 2-core machine a Redis round trip can
exceed the 5 ms default, and a decision without the registry's answer routes on load alone."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from prefixmesh.router.policy.ring import ReplicaRing
from tests.integration.router.conftest import BLOCK, CANDIDATES, REPLICAS, Cluster, document

pytestmark = pytest.mark.redis
DOC_BLOCKS = 12
HEAD_BLOCKS = 2  # group_tokens 256 / 128-token blocks
DEADLINE = "registry.lookup_deadline_ms=100"


async def test_same_prefix_same_holder_from_every_router(cluster: Cluster) -> None:
    a, b = await cluster.router(1, DEADLINE), await cluster.router(2, DEADLINE)
    doc = document(0, DOC_BLOCKS)
    holder = REPLICAS[3]
    await cluster.publish_stored(holder, cluster.request(doc, 0).key.block_hashes[:DOC_BLOCKS])
    for i in range(10):
        router = (a, b)[i % 2]
        request = cluster.request(doc, i)
        decision = await router.decide(request, CANDIDATES)
        assert decision.chosen == holder, (i, decision)
        assert decision.matched_blocks == DOC_BLOCKS
        assert decision.claim is None and decision.hold is None  # warm: nothing to claim


async def test_a_hot_group_has_the_same_members_from_every_router(cluster: Cluster) -> None:
    """A hot group's requests go to its ring members (plus the replica that already holds the
    document), and both routers compute the same members (the ring is md5, not per-process).
    The group is hot from its first request here (``affinity_min_requests=1``)."""
    hot = "routing.prefixmesh.affinity_min_requests=1"
    a, b = await cluster.router(1, DEADLINE, hot), await cluster.router(2, DEADLINE, hot)
    doc = document(1, DOC_BLOCKS)
    key = cluster.request(doc, 0).key.block_hashes
    holder = REPLICAS[3]
    await cluster.publish_stored(holder, key[:DOC_BLOCKS])
    group = key[HEAD_BLOCKS - 1]
    # Traffic that sizes the group at k = 2: one replica's worth (1.0 busy-seconds per second,
    # 1.43 replicas at the 0.7 target utilisation) as a router that has just met the group
    # reads it: the decayed rate (weight * ln 2 / half-life) times its warm-up correction.
    policy = a.config.routing.prefixmesh
    rate_per_weight = math.log(2) / a.config.registry.hotness_half_life_s
    weight = 1.0 / (rate_per_weight * policy.affinity_warmup_max_boost)
    registry = await cluster.client()
    await registry.touch(group, weight)
    ring = ReplicaRing(policy.ring_vnodes)
    ring.sync(REPLICAS)
    members = set(ring.members(group, 2))
    chosen: dict[int, set[str]] = {id(a): set(), id(b): set()}
    reasons: Counter[str] = Counter()
    for i in range(12):
        router = (a, b)[i % 2]
        request = cluster.request(doc, i)
        decision = await router.decide(request, CANDIDATES)
        chosen[id(router)].add(decision.chosen)
        reasons[decision.reason] += 1
        with router.local.lock:
            router.local.ledger.finished(request.request_id)
    assert reasons["affinity"] == 12, reasons
    for router in (a, b):
        assert chosen[id(router)] <= members | {holder}, (chosen, members)
        # The policies hold the same ring: the same members for this group.
        assert set(router.policy.ring.members(group, 2)) == members


async def test_routers_do_not_herd_between_reports(cluster: Cluster) -> None:
    """20 cold distinct prompts from two routers while the replicas' reports stay frozen at
    idle: each router counts its own decisions at once, and the near-best pick is random, so
    neither pile onto one replica."""
    a, b = await cluster.router(1, DEADLINE), await cluster.router(2, DEADLINE)
    counts: Counter[str] = Counter()
    for i in range(20):
        router = (a, b)[i % 2]
        decision = await router.decide(cluster.request(document(100 + i, 8), i), CANDIDATES)
        counts[decision.chosen] += 1
    assert sum(counts.values()) == 20
    assert max(counts.values()) <= math.ceil(20 / len(REPLICAS)) + 2, counts


async def test_a_new_router_starts_from_redis(cluster: Cluster) -> None:
    """Events published before a router exists: its first decision routes on them."""
    doc = document(2, DOC_BLOCKS)
    holder = REPLICAS[2]
    await cluster.publish_stored(holder, cluster.request(doc, 0).key.block_hashes[:DOC_BLOCKS])
    late = await cluster.router(3, DEADLINE)
    request = cluster.request(doc, 1)
    decision = await late.decide(request, CANDIDATES)
    assert decision.chosen == holder
    assert decision.matched_blocks == DOC_BLOCKS
    assert decision.hold is None
    assert len(request.prompt_token_ids) - DOC_BLOCKS * BLOCK < BLOCK  # only the question left
