"""In-flight claims: delay-hit holds that work across routers (pure helpers of ``RoutingCore``).

A hold normally comes from the policy, which sees the speculative entry a router wrote when it
sent a prefix to be computed. That entry is written after the decision, so two ingresses that
route siblings of a cold long prefix in the same millisecond both miss it and both compute the
prefix. A claim closes the gap: when a decision sends at least ``hold_min_tokens`` that no
candidate holds to be computed, the router claims the prefix's head in the registry for the
chosen replica (an atomic set-if-absent with a TTL). The first claimant wins; a router whose
claim finds another holder turns its decision into a hold on that holder. The replica releases
the claim at the request's first chunk, when its blocks are stored and the registry shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash, PrefixHit, ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.policy.base import (
    Hold,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)

CLAIM_REASON = "hold_claim"
"""The reason of a decision turned into a hold by another router's claim."""


@dataclass(frozen=True, slots=True)
class ClaimSettings:
    enabled: bool
    claim_blocks: int
    """Leading blocks a claim names: the prefix group's head, and at least ``hold_min_tokens``
    (a sibling sharing less would not be held for it)."""
    min_tokens: int
    wait_factor: float
    wait_share: float = 0.5
    min_wait_s: float = 0.005
    max_wait_s: float = 0.25
    slack_s: float = 0.05
    """Added to every bound: a replica's first token arrives a step after its prefill."""

    @classmethod
    def from_config(cls, config: PrefixmeshConfig) -> ClaimSettings:
        policy = config.routing.prefixmesh
        block_size = config.cache.block_size
        return cls(
            enabled=(
                config.routing.policy == "prefixmesh"
                and policy.holds_enabled
                and policy.hold_claims
            ),
            claim_blocks=max(1, max(policy.group_tokens, policy.hold_min_tokens) // block_size),
            min_tokens=max(1, policy.hold_min_tokens),
            wait_factor=policy.hold_wait_factor,
            wait_share=policy.hold_claim_wait_share,
            min_wait_s=config.registry.lookup_deadline_ms / 1000,
            max_wait_s=max(config.registry.op_timeout_ms, config.registry.lookup_deadline_ms)
            / 1000,
        )


def claim_prefix(
    settings: ClaimSettings,
    request: RouteRequest,
    decision: RouteDecision,
    hits: Mapping[ReplicaId, PrefixHit],
) -> BlockHash | None:
    """The prefix to claim for this decision, if it sends a cold long prefix to be computed.

    Not when the policy holds (it saw the prefix in flight), when the chosen replica computes
    fewer than ``min_tokens``, or when any candidate already holds the claimed head, confirmed
    or speculatively: the policy weighed that holder already, and a claim must not overrule it.
    """
    if not settings.enabled or decision.hold is not None:
        return None
    hashes = request.key.block_hashes
    blocks = settings.claim_blocks
    if len(hashes) < blocks:
        return None
    if any(hit.num_blocks >= blocks for hit in hits.values()):
        return None
    hit = hits.get(decision.chosen)
    uncached = request.prompt_tokens - (hit.num_blocks * request.key.block_size if hit else 0)
    if uncached < settings.min_tokens:
        return None
    return hashes[blocks - 1]


def expected_ready_s(snapshot: ReplicaSnapshot, tokens: int) -> float:
    """When a prompt of ``tokens`` sent to the replica now should have its first token: its
    queued prefill and this one at its peak rate, plus a step (the queue term keeps a busy
    replica's claim alive until it gets to the prompt)."""
    capacity = snapshot.capacity
    rate = capacity.prefill_tokens_per_s
    queued = max(snapshot.pending_prefill_tokens, 0) + max(tokens, 0)
    return float((queued / rate if rate > 0 else 0.0) + capacity.decode_step_s)


def bound_s(settings: ClaimSettings, snapshot: ReplicaSnapshot, tokens: int) -> float:
    """A claim's TTL and a claim hold's bound: generous (the release or the first token ends
    both early when all goes well), finite (a failed request frees its siblings)."""
    return settings.wait_factor * expected_ready_s(snapshot, tokens) + settings.slack_s


def claim_wait_s(settings: ClaimSettings, snapshot: ReplicaSnapshot, tokens: int) -> float:
    """How long the decision may wait for the registry's answer to its claim: a share of the
    prefill the claim may save siblings, within [lookup deadline, op timeout]."""
    rate = snapshot.capacity.prefill_tokens_per_s
    prefill_s = max(tokens, 0) / rate if rate > 0 else 0.0
    wait_s = settings.wait_share * prefill_s
    return min(settings.max_wait_s, max(settings.min_wait_s, wait_s))


def held_on(decision: RouteDecision, holder: ReplicaId, hold: Hold) -> RouteDecision:
    """The decision sent to ``holder`` with ``hold``; the rest of its ranking stays as the
    fallback order (a hold binds to the first replica only)."""
    rest = tuple(
        kept for tier in decision.ranked if (kept := tuple(r for r in tier if r != holder))
    )
    return RouteDecision(((holder,), *rest), hold, CLAIM_REASON)
