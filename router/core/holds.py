"""Delay-hit holds, the router's side: the one module for them (``replica/admission/holds.py`` is
the replica's, which waits them out).

A hold normally comes from the policy (``PrefixmeshPolicy``), which sees the speculative entry
a router wrote when it sent a prefix to be computed and weighs waiting for it against the
alternatives. That entry is written after the decision, so two routers that route siblings of
a cold long prefix in the same millisecond both miss it and both compute the prefix. A claim
closes the gap: when a decision sends at least ``hold_min_tokens`` that no candidate holds to be
computed, the router claims the prefix's head in the registry for the chosen replica (an atomic
set-if-absent with a TTL, ``claim``). The first claimant wins; a router whose claim finds
another holder turns its decision into a hold on that holder.

Claims are released on one path, by the router that took them, through its ledger
(``release``): at the request's first token or end (the proxy path's callbacks), when a
replica's report lists the request as arrived (the direct path: the speculative entry, written
before the request left, covers siblings from then on), when the request moves or expires. The
TTL ends a claim whose router died. What reaches the replica is the decision's ``Hold`` itself,
in its ``RouteTicket``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.cache_registry.protocol import CacheRegistry, settled
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
    queued prefill and this one at its peak rate, with their attention where the replica
    reports its cost, plus a step (the queue term keeps a busy replica's claim alive until it
    gets to the prompt; the attention keeps a long prompt's claim alive until it is done)."""
    capacity = snapshot.capacity
    rate = capacity.prefill_tokens_per_s
    queued = max(snapshot.pending_prefill_tokens, 0) + max(tokens, 0)
    attention_s = capacity.prefill_attention_s(tokens, tokens)
    if snapshot.pending_prefill_tokens > 0 and snapshot.pending_attention_s > 0:
        attention_s += snapshot.pending_attention_s
    return float((queued / rate if rate > 0 else 0.0) + attention_s + capacity.decode_step_s)


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


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a claim attempt made of a decision."""

    decision: RouteDecision
    """The decision, or the decision turned into a hold on the replica that claimed first."""
    claim: BlockHash | None
    """The prefix claimed for the chosen replica (its router's ledger releases it)."""
    wait_s: float
    """How long the decision may wait on the registry (for its speculative entry, too)."""


async def claim(
    registry: CacheRegistry,
    settings: ClaimSettings,
    prefix: BlockHash,
    route: RouteRequest,
    decision: RouteDecision,
    snapshots: Sequence[ReplicaSnapshot],
    keep: Callable[[asyncio.Future[Any]], None],
) -> Claimed:
    """Claim ``prefix`` for the chosen replica, waiting at most ``claim_wait_s`` for the
    registry's answer. ``keep`` holds a late attempt until it lands."""
    chosen = decision.chosen
    by_id = {snapshot.replica_id: snapshot for snapshot in snapshots}
    ttl_s = bound_s(settings, by_id[chosen], route.prompt_tokens)
    wait_s = claim_wait_s(settings, by_id[chosen], route.prompt_tokens)
    attempt = asyncio.ensure_future(registry.claim_inflight(prefix, chosen, ttl_s))
    if not await settled(attempt, wait_s):
        # The claim may land: carry it (releasing a claim we do not hold is a no-op), and
        # compute as if no one else were.
        keep(attempt)
        return Claimed(decision, prefix, wait_s)
    holder = attempt.result()
    if holder == chosen:
        return Claimed(decision, prefix, wait_s)
    if holder is None or (snapshot := by_id.get(holder)) is None:
        return Claimed(decision, None, wait_s)  # no answer, or a holder we may not use (avoided)
    hold = Hold(settings.claim_blocks, bound_s(settings, snapshot, route.prompt_tokens))
    return Claimed(held_on(decision, holder, hold), None, wait_s)


async def release(registry: CacheRegistry, prefix: BlockHash, replica: ReplicaId) -> None:
    """Release ``replica``'s claim on ``prefix`` (a no-op if another holds it now)."""
    await registry.release_inflight(prefix, replica)
