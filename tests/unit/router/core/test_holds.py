"""In-flight claims in ``RoutingCore`` with the in-process registry and no Ray: a cold long prefix
is claimed for the replica sent to compute it; a decision that finds another replica's claim is
held there; the ingress's first token (the ledger) releases the claim, through the registry."""

from __future__ import annotations

import uuid

import pytest

from prefixmesh.cache_registry.factory import make_hasher, make_memory_state
from prefixmesh.cache_registry.types import CacheEvent, EventKind, ReplicaId, Tier
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.router.core.decide import Candidate, RoutingCore
from prefixmesh.router.core.holds import CLAIM_REASON
from prefixmesh.router.core.local_state import LocalRouterState
from prefixmesh.wire import GenerateRequest, ReplicaReport, SamplingSettings

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]
DOCUMENT = list(range(1000, 1000 + 12 * 128))  # 12 blocks: far above hold_min_tokens
HEAD_BLOCKS = 2  # group_tokens 256 / block_size 128


def config(*overrides: str) -> PrefixmeshConfig:
    overrides = (f"app_name=claims-{uuid.uuid4().hex[:8]}", "cache.block_size=128", *overrides)
    return load_config(overrides=overrides)


def core_on(state: LocalRouterState, *overrides: str) -> RoutingCore:
    return RoutingCore(config(*overrides), state)


def fresh_state() -> LocalRouterState:
    return LocalRouterState(make_memory_state(config()))


def request(question: int, tokens: list[int] = DOCUMENT) -> GenerateRequest:
    ids = [*tokens, 7, question, 7, question]
    key = make_hasher(config()).hash_tokens(ids)
    return GenerateRequest(f"cmpl-{uuid.uuid4().hex}", tuple(ids), key, SamplingSettings(8))


def candidates(*names: ReplicaId) -> list[Candidate]:
    return [Candidate(r, ReplicaReport()) for r in names or REPLICAS]


async def test_a_cold_long_prefix_is_claimed_for_its_replica() -> None:
    state = fresh_state()
    core = core_on(state)
    first = request(1)
    decision = await core.decide(first, candidates())
    head = first.key.block_hashes[HEAD_BLOCKS - 1]
    assert decision.hold is None
    assert decision.claim == head
    assert state.registry.live_claim(head) is not None
    assert state.registry.live_claim(head)[0] == decision.chosen  # type: ignore[index]
    # The ingress sees the first token: the ledger releases the claim (on the router's loop).
    with state.lock:
        state.ledger.first_token(first.request_id)
    await core.settle()
    assert state.registry.live_claim(head) is None


async def test_another_replicas_claim_turns_the_decision_into_a_hold_there() -> None:
    state = fresh_state()
    core = core_on(state)
    sibling = request(2)
    head = sibling.key.block_hashes[HEAD_BLOCKS - 1]
    # Another router claimed the head for r3 and its speculative entry is not visible yet;
    # r3 has a queue, so this router's own pick is elsewhere.
    state.registry.claim_inflight(head, REPLICAS[3], 5.0)
    with state.lock:
        state.ledger.routed("queued-on-r3", REPLICAS[3], 4000)
    decision = await core.decide(sibling, candidates())
    assert decision.chosen == REPLICAS[3]
    assert decision.reason == CLAIM_REASON
    assert decision.hold is not None and decision.hold.num_blocks == HEAD_BLOCKS
    assert 0 < decision.hold.max_wait_s < 5.0
    assert decision.claim is None  # the held request computes nothing worth claiming
    assert len(decision.ranked) > 1  # the other candidates stay as fallbacks


async def test_a_claim_by_a_replica_that_is_not_a_candidate_is_ignored() -> None:
    state = fresh_state()
    core = core_on(state)
    sibling = request(3)
    head = sibling.key.block_hashes[HEAD_BLOCKS - 1]
    state.registry.claim_inflight(head, ReplicaId("gone"), 5.0)
    decision = await core.decide(sibling, candidates())
    assert decision.hold is None and decision.reason != CLAIM_REASON
    assert decision.claim is None


async def test_no_claim_for_a_warm_prefix_a_short_prompt_or_when_disabled() -> None:
    state = fresh_state()
    core = core_on(state)
    warm = request(4)
    stored = CacheEvent(EventKind.STORED, REPLICAS[1], 0, 0, Tier.GPU, warm.key.block_hashes[:12])
    state.registry.publish([stored])
    routed = await core.decide(warm, candidates())
    assert routed.chosen == REPLICAS[1] and routed.claim is None
    short = request(5, tokens=list(range(200)))  # one block: below hold_min_tokens
    assert (await core.decide(short, candidates())).claim is None
    off = core_on(fresh_state(), "routing.prefixmesh.hold_claims=false")
    cold = request(6, tokens=[t + 1 for t in DOCUMENT])
    assert (await off.decide(cold, candidates())).claim is None


def test_a_claim_waits_a_share_of_the_prefill_it_can_save() -> None:
    from prefixmesh.router.core.holds import ClaimSettings, claim_wait_s
    from prefixmesh.router.policy.base import ReplicaCapacity, ReplicaSnapshot

    settings = ClaimSettings.from_config(config())
    capacity = ReplicaCapacity(
        prefill_tokens_per_s=10_000.0, decode_step_s=0.02, max_batch_tokens=2048, kv_blocks=100
    )
    snapshot = ReplicaSnapshot(REPLICAS[0], capacity, 0, 0, 0, 0)
    assert claim_wait_s(settings, snapshot, 1000) == 0.5 * 0.1  # half of a 0.1 s prefill
    assert claim_wait_s(settings, snapshot, 10) == 0.005  # never below the lookup deadline
    assert claim_wait_s(settings, snapshot, 10**6) == 0.25  # nor above the op timeout


def test_a_long_prompts_claim_lasts_until_its_attention_heavy_prefill_is_done() -> None:
    # Regression: the bound was linear in the tokens, so on a replica that reports an
    # attention cost a long prompt's claim (and its siblings' holds) ran out before its first
    # token, and the siblings computed it again.
    from prefixmesh.router.core.holds import ClaimSettings, bound_s, expected_ready_s
    from prefixmesh.router.policy.base import ReplicaCapacity, ReplicaSnapshot

    settings = ClaimSettings.from_config(config())
    linear = ReplicaCapacity(10_000.0, 0.02, 2048, 100)
    quadratic = ReplicaCapacity(10_000.0, 0.02, 2048, 100, attn_s_per_token_pair=1e-9)
    idle = ReplicaSnapshot(REPLICAS[0], quadratic)
    # 100k tokens: 10 s at the rate, plus 100k x (50k - 1024) pairs at 1 ns.
    attention = 100_000 * (50_000 - 1024) * 1e-9
    assert expected_ready_s(idle, 100_000) == pytest.approx(10.0 + attention + 0.02)
    assert expected_ready_s(ReplicaSnapshot(REPLICAS[0], linear), 100_000) == 10.0 + 0.02
    # A replica deep in another long prompt: its reported attention is waited for too.
    busy = ReplicaSnapshot(
        REPLICAS[0], quadratic, pending_prefill_tokens=20_000, pending_attention_s=3.0
    )
    assert expected_ready_s(busy, 100_000) == pytest.approx(12.0 + attention + 3.0 + 0.02)
    assert bound_s(settings, busy, 100_000) == (
        settings.wait_factor * expected_ready_s(busy, 100_000) + settings.slack_s
    )
