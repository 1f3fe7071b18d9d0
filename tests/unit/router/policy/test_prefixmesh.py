"""The prefixmesh policy, one mechanism per test (block size 4, 1,000 prefill tokens/s)."""

from __future__ import annotations

import pytest
from uhashring import HashRing

from prefixmesh.cache_registry.types import SHARED_TIER
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaCapacity,
    RouteDecision,
    RouteRequest,
    registry_view,
)
from prefixmesh.router.policy.prefixmesh_policy import PrefixmeshPolicy
from tests.unit.router.policy.builders import (
    CAPACITY,
    chain,
    chosen_ids,
    fleet,
    hit,
    policy,
    request,
    rid,
    snap,
    view,
)

NAMES = tuple(f"r{i}" for i in range(8))
GROUP_HEAD = (1, 2)  # group_tokens = 8: the first 2 blocks name the group


BASE = {
    "group_tokens": 8,
    "hold_min_tokens": 8,
    "affinity_warmup_max_boost": 1.0,
    "affinity_min_requests": 1,
}
"""Small groups and holds for block size 4; group rates taken as given from the first request
(the warm-up correction and the minimum request count have their own tests)."""


def prefixmesh(seed: int = 0, **section: object) -> PrefixmeshPolicy:
    built = policy("prefixmesh", seed, **(BASE | section))
    assert isinstance(built, PrefixmeshPolicy)
    return built


def group_request(suffix: int, request_id: str = "q") -> RouteRequest:
    return request(*GROUP_HEAD, suffix, suffix + 1, request_id=request_id)


def ring_members(names: tuple[str, ...], k: int) -> set[str]:
    ring = HashRing(nodes=list(names))
    return {node["nodename"] for node in ring.range(str(chain(*GROUP_HEAD)[1]), k)}


def chosen_over(pm: PrefixmeshPolicy, names: tuple[str, ...], rate: float, n: int = 60) -> set[str]:
    replicas = fleet(*names)
    return {
        str(pm.route(group_request(100 + i), replicas, view(group_rate=rate), 0.0).chosen)
        for i in range(n)
    }


def test_a_hot_prefix_spreads_over_k_ring_replicas_that_follow_its_rate() -> None:
    pm = prefixmesh()
    # Target utilization 0.7: 1.0 busy-s/s needs ceil(1.43) = 2 replicas, 2.0 needs 3.
    assert chosen_over(pm, NAMES, rate=1.0) == ring_members(NAMES, 2)
    assert chosen_over(pm, NAMES, rate=2.0) == ring_members(NAMES, 3)
    assert ring_members(NAMES, 2) < ring_members(NAMES, 3)  # growing keeps the members
    # 1.3 needs 1.86 replicas: 2 would do, but not with 25 % headroom, so k stays 3 ...
    assert chosen_over(pm, NAMES, rate=1.3) == ring_members(NAMES, 3)
    # ... while at 1.0 (1.43 x 1.25 = 1.79) it shrinks back to the same 2 members.
    assert chosen_over(pm, NAMES, rate=1.0) == ring_members(NAMES, 2)
    decision = pm.route(group_request(7), fleet(*NAMES), view(group_rate=1.0), 0.0)
    assert decision.reason == "affinity"
    assert set(chosen_ids(decision.ranked)) == ring_members(NAMES, 2)  # members only
    # Cooled: the group is free again and idle replicas all tie.
    assert len(chosen_over(pm, NAMES, rate=0.1)) > 3
    assert pm.route(group_request(7), fleet(*NAMES), view(group_rate=0.1), 0.0).reason == (
        "least_ttft"
    )


def test_within_a_hot_group_the_estimate_picks_and_busy_members_spill() -> None:
    members = sorted(ring_members(NAMES, 2))
    busy = {members[0]: 500}  # ~0.55 s of queued prefill: within the guard, but slower
    replicas = [snap(n, pending=busy.get(n, 0)) for n in NAMES]
    for seed in range(10):
        decision = prefixmesh(seed).route(group_request(9), replicas, view(group_rate=1.0), 0.0)
        assert (str(decision.chosen), decision.reason) == (members[1], "affinity")
    overloaded = [snap(n, pending=1500 if n in members else 0) for n in NAMES]
    guarded = prefixmesh(overload_wait_s=1.0)  # 1.65 s queued: overloaded at a 1 s guard
    decision = guarded.route(group_request(9), overloaded, view(group_rate=1.0), 0.0)
    assert decision.reason == "spill"
    assert not set(chosen_ids(decision.ranked)) & set(members)
    # Merely busier members (0.12 s queued, within the guard) also spill once they are
    # affinity_slack_s dearer than an idle replica; with an infinite slack they keep it.
    busier = [snap(n, pending=100 if n in members else 0) for n in NAMES]
    decision = prefixmesh().route(group_request(9), busier, view(group_rate=1.0), 0.0)
    assert decision.reason == "spill" and str(decision.chosen) not in members
    sticky = prefixmesh(affinity_slack_s=float("inf"))
    decision = sticky.route(group_request(9), busier, view(group_rate=1.0), 0.0)
    assert decision.reason == "affinity" and str(decision.chosen) in members


def test_a_cold_prefix_stays_on_its_single_holder() -> None:
    replicas = [snap("a"), snap("b", pending=20), snap("c"), snap("d")]
    for seed in range(10):
        decision = prefixmesh(seed).route(
            request(*range(10)), replicas, view(group_rate=0.1, b=hit(gpu=8)), 0.0
        )
        # b: 27 ms wait + one 18 ms step for 8 tokens + 4 ms penalty = 49 ms, while 40 tokens
        # elsewhere take 50 ms + 20 ms penalty.
        assert (str(decision.chosen), decision.reason) == ("b", "least_ttft")
        assert decision.hold is None


def test_siblings_of_an_in_flight_prefix_are_held_on_its_replica_with_a_bounded_wait() -> None:
    # b is computing blocks 2..7 of this prompt right now (its 32 pending tokens; speculative
    # entries); a and c hold nothing and are decoding 10 requests each.
    replicas = [snap("a", running=10), snap("b", pending=32), snap("c", running=10)]
    hits = view(b=hit(gpu=8, speculative=6))
    decision = prefixmesh().route(request(*range(10)), replicas, hits, 0.0)
    assert (str(decision.chosen), decision.reason) == ("b", "hold")
    # Stored once b's queue drains (half a step + 32 tokens, the in-flight prefill itself) or
    # after the in-flight blocks alone (24 tokens at 1.1 ms), whichever is longer; the bound
    # is hold_wait_factor 2 times that.
    queue_s = 0.5 * 0.01 + 32 * 0.0011
    assert decision.hold == Hold(num_blocks=8, max_wait_s=pytest.approx(2 * queue_s))
    # Its first token comes no sooner than the blocks it waits for.
    assert decision.expected_ttft_s is not None and decision.expected_ttft_s >= queue_s
    # Without holds the estimate sends it to b all the same, without waiting.
    unheld = prefixmesh(holds_enabled=False).route(request(*range(10)), replicas, hits, 0.0)
    assert (str(unheld.chosen), unheld.hold) == ("b", None)
    # Too little in flight beyond what is confirmed anywhere: no hold.
    short = prefixmesh(hold_min_tokens=28).route(request(*range(10)), replicas, hits, 0.0)
    assert (str(short.chosen), short.hold) == ("b", None)
    # b has fallen behind (computing the prefix elsewhere is now faster): no hold, elsewhere.
    behind = [snap("a", running=10), snap("b", pending=200), snap("c", running=10)]
    decision = prefixmesh().route(request(*range(10)), behind, hits, 0.0)
    assert decision.hold is None and str(decision.chosen) != "b"
    # b is overloaded outright: never held there.
    overloaded = [snap("a"), snap("b", pending=2000), snap("c")]
    decision = prefixmesh().route(request(*range(10)), overloaded, hits, 0.0)
    assert decision.hold is None and str(decision.chosen) != "b"


def test_a_decision_says_when_its_first_token_should_come_attention_included() -> None:
    # 1,000 tokens on an idle replica: 10 steps of 100 tokens (1.0 s) + 10 ms each, and the
    # attention its rate does not count, 1,000 x (1,000 - 500 - 50) pairs at 1 us.
    capacity = ReplicaCapacity(1000.0, 0.01, 100, 1000, attn_s_per_token_pair=1e-6)
    decision = prefixmesh().route(request(*range(250)), [snap("a", capacity=capacity)], view(), 0)
    assert decision.expected_ttft_s == pytest.approx(1.1 + 0.45)
    # Its routing-time registry entries live that much longer than the base lifetime.
    assert decision.speculative_ttl_s(2.0) == pytest.approx(2.0 + 1.55)
    for unknown in (None, float("inf"), float("nan")):
        assert RouteDecision(decision.ranked, expected_ttft_s=unknown).speculative_ttl_s(2.0) == 2.0


def test_an_overloaded_holder_loses_only_its_own_excess_traffic() -> None:
    # a holds prefix P and is overloaded (1.7 s queued > 0 + 1.0 s); d holds Q, busy (0.3 s).
    replicas = [snap("a", pending=1500), snap("b"), snap("c"), snap("d", pending=300)]
    p = request(*range(100))
    q = request(*range(500, 600))
    for seed in range(10):
        pm = prefixmesh(seed, overload_wait_s=1.0)
        on_p = pm.route(p, replicas, view(a=hit(gpu=100), b=hit(gpu=50)), 0.0)
        # Rebalanced to the longest match among the rest, not to the plain least loaded.
        assert (str(on_p.chosen), on_p.reason) == ("b", "overload")
        assert "a" not in chosen_ids(on_p.ranked)
        on_q = pm.route(q, replicas, view(d=hit(gpu=96)), 0.0)
        assert (str(on_q.chosen), on_q.reason) == ("d", "least_ttft")


def test_a_backlogged_fleet_keeps_its_affinity() -> None:
    p = request(*range(100))  # 400 tokens; a holds 90 blocks of them
    hits = view(a=hit(gpu=90))
    # Idle fleet: a's 0.67 s queue costs more than b recomputing 400 tokens (0.44 s + penalty).
    idle = [snap("a", pending=600), snap("b")]
    assert str(prefixmesh().route(p, idle, hits, 0.0).chosen) == "b"
    # Every replica backlogged: b 1.99 s, a 2.76 s. The guard keeps a (less than 1.5 times
    # b's wait) and recomputing is priced by the backlog (penalty 0.5 + 1.98 s / 1 s), so a
    # keeps P: 2.90 against b's 3.42.
    backlogged = [snap("a", pending=2500), snap("b", pending=1800)]
    pm = prefixmesh(overload_wait_s=1.0)
    first = pm.route(p, backlogged, hits, 0.0)  # priced with the backlog seen before: none
    assert str(first.chosen) == "b"
    second = pm.route(p, backlogged, hits, 0.0)
    assert (str(second.chosen), second.reason) == ("a", "least_ttft")
    # Beyond 1.5 times the least-loaded wait, the guard takes a out after all.
    far_behind = [snap("a", pending=3500), snap("b", pending=1800)]
    pm.route(p, far_behind, hits, 0.0)
    decision = pm.route(p, far_behind, hits, 0.0)
    assert (str(decision.chosen), decision.reason) == ("b", "overload")


def test_near_ties_are_random_across_seeds_and_repeatable_for_one_seed() -> None:
    replicas = [snap("a"), snap("b"), snap("c"), snap("d", pending=20)]  # d: 27 ms behind
    chosen = {
        str(prefixmesh(seed).route(request(1, 2), replicas, view(), 0.0).chosen)
        for seed in range(30)
    }
    assert chosen == {"a", "b", "c"}
    first, second = prefixmesh(5), prefixmesh(5)
    runs = [
        [str(pm.route(request(1, i), replicas, view(), 0.0).chosen) for i in range(20)]
        for pm in (first, second)
    ]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1
    # A wide enough band takes d in too.
    wide = {
        str(
            prefixmesh(seed, near_best_abs_s=0.05)
            .route(request(1, 2), replicas, view(), 0.0)
            .chosen
        )
        for seed in range(40)
    }
    assert "d" in wide


def test_a_tp2_replica_with_twice_the_prefill_rate_wins_an_equal_comparison() -> None:
    tp2 = CAPACITY.__class__(2000.0, 0.01, 200, 2000, tp_degree=2)
    for pending in (100, 0):
        replicas = [snap("tp1", pending=pending), snap("tp2", pending=pending, capacity=tp2)]
        for seed in range(10):
            decision = prefixmesh(seed).route(request(*range(10)), replicas, view(), 0.0)
            assert str(decision.chosen) == "tp2"


def test_added_and_removed_replicas() -> None:
    pm = prefixmesh()
    before = ring_members(NAMES, 3)
    assert chosen_over(pm, NAMES, rate=2.0) == before
    grown = (*NAMES, "r8", "r9")
    after = chosen_over(pm, grown, rate=2.0)
    assert after == ring_members(grown, 3) and len(after - before) <= 2
    gone = sorted(before)[0]
    pm.on_replica_removed(rid(gone))
    shrunk = tuple(n for n in grown if n != gone)
    assert chosen_over(pm, shrunk, rate=2.0) == ring_members(shrunk, 3)
    assert after - {gone} <= ring_members(shrunk, 3)  # the other members stay
    one = pm.route(group_request(1), fleet("solo"), view(group_rate=50.0), 0.0)
    assert chosen_ids(one.ranked) == ["solo"]


def test_groups_and_their_traffic_weight() -> None:
    pm = prefixmesh()
    assert pm.prefix_group(request(1, 2, 3)) == chain(1, 2)[1]
    assert pm.prefix_group(request(1)) is None  # shorter than the head
    assert prefixmesh(group_tokens=2).prefix_group(request(1, 2)) == chain(1)[0]
    req = request(*range(10), output=64, request_id="w")
    assert pm.traffic_weight(req) == 0.0  # nothing known about the fleet yet
    pm.route(req, [snap("a"), snap("b")], view(a=hit(gpu=8)), 0.0)
    # a computes 8 tokens (8 / 1000 s); each of the 64 output tokens costs 0.01 s / 32 of the
    # step's fixed part plus one token's compute (1 ms: nothing learned about decode yet).
    decode_s = 64 * (0.01 / 32 + 0.001)
    assert pm.traffic_weight(req) == pytest.approx(0.008 + decode_s)
    other = request(*range(10), output=64, request_id="other")
    assert pm.traffic_weight(other) == pytest.approx(0.032 + decode_s)  # beyond the head


def test_members_are_credited_only_with_what_the_group_s_prompts_share() -> None:
    # A hot group (k = 2); replica x, not a member, holds this prompt's own 20-block history
    # beyond the group head (a conversation). The members share only the head with it, so they
    # are not credited with x's history: x is 20 ms busier, but recomputing 80 tokens on an
    # idle member would take 80 ms more.
    members = ring_members(NAMES, 2)
    holder = next(n for n in NAMES if n not in members)
    pm = prefixmesh()
    replicas = [snap(n, pending=20 if n == holder else 0) for n in NAMES]
    for n in range(2):  # the group's earlier prompts: the head, then their own questions
        pm.route(group_request(100 + n), replicas, view(group_rate=1.0), 0.0)
    conversation = request(*GROUP_HEAD, *range(50, 72), request_id="turn-2")
    history = {holder: hit(gpu=22)}
    decision = pm.route(conversation, replicas, view(group_rate=1.0, **history), 0.0)
    assert str(decision.chosen) == holder
    # A prompt the group's prompts share in full (a shared document) credits the members, who
    # then compete on load: the idle members win over the busier holder.
    shared = prefixmesh()
    document = [request(*GROUP_HEAD, *range(50, 72), 90 + n, request_id=f"d{n}") for n in range(3)]
    for earlier in document[:2]:
        shared.route(earlier, replicas, view(group_rate=1.0, **history), 0.0)
    decision = shared.route(document[2], replicas, view(group_rate=1.0, **history), 0.0)
    assert str(decision.chosen) in members


def test_the_shared_tier_lets_a_request_go_where_the_queue_is_short_and_skip_its_prefill() -> None:
    reads = ReplicaCapacity(1000.0, 0.01, 100, 1000, shared_load_s_per_block=0.0002)
    req = request(*range(1, 101))  # 400 tokens: 0.4 s to compute, 20 ms to load from the tier
    busy = snap("busy", running=4, queued=1, pending=120, capacity=reads)
    idle = snap("idle", capacity=reads)
    holder = {rid("busy"): hit(gpu=100)}
    # Without the shared tier, the holder's queue costs less than computing the prompt.
    without = prefixmesh().route(req, [busy, idle], RegistryView(holder), 0.0)
    assert chosen_ids(without.ranked)[0] == "busy"
    # With it, the idle replica loads what it lacks and skips the queue.
    shared = registry_view({**holder, SHARED_TIER: hit(disk=100)})
    assert shared.shared_blocks == 100
    decision = prefixmesh().route(req, [busy, idle], shared, 0.0)
    assert chosen_ids(decision.ranked)[0] == "idle"
