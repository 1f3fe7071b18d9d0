"""The request-independent part of the TTFT estimate (``ttft.py``), kept per replica snapshot:
``ReplicaTerms`` folds each candidate's step times, queue wait and backlog into ``CostTerms``
(recomputed only for the snapshots that changed), and ``candidate_costs`` turns them, with the
tokens each candidate computes and what it loads, into every candidate's cost in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import compress
from operator import is_not

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.router.policy.base import ReplicaSnapshot

TINY_RATE = 1e-9
"""Stands in for a zero or negative rate in a snapshot, so a broken report cannot divide by
zero: such a replica just looks hopelessly slow."""
TINY_STEP_S = 1e-9
"""Likewise for a zero step time next to an infinite prefill rate."""


CostTerms = tuple[float, float, float, float, float, float]
"""One replica's request-independent terms, folded so that its cost for computing u tokens is
``fixed + u * (price * token_s + delay)`` when u fits one step's chunk, else
``chunked + u * (per_token + price * token_s)``: (chunk, fixed, token_s, delay, per_token,
chunked), with fixed = wait + decode step, delay = waiting requests x queue externality x
token_s, per_token = decode step / chunk, chunked = wait + delay x chunk."""


class ReplicaTerms:
    """The request-independent part of every candidate's estimate, kept per snapshot object."""

    __slots__ = (
        "attention",
        "attention_above",
        "backlogs",
        "cost_terms",
        "ext",
        "fleet_version",
        "min_share",
        "position",
        "running_cost",
        "snapshots",
        "waits",
    )

    def __init__(self, min_share: float, ext: float) -> None:
        self.min_share = min_share
        self.ext = ext
        self.running_cost = math.nan
        self.snapshots: list[ReplicaSnapshot] = []
        self.cost_terms: list[CostTerms] = []
        self.waits: list[float] = []
        self.backlogs: list[float] = []
        self.position: dict[ReplicaId, int] = {}
        self.fleet_version = 0
        """Bumped whenever the candidates' ids or their order change."""
        self.attention: list[tuple[float, float]] = []
        """Per replica: its attention cost per pair and half its step budget
        (``ReplicaCapacity.prefill_attention_s``)."""
        self.attention_above = math.inf
        """Only prompts longer than this can cost attention anywhere (the least half budget of
        a replica that reports an attention cost; inf: none does), so short prompts skip it.
        Never raised until the fleet changes."""

    def update(self, replicas: Sequence[ReplicaSnapshot], running_cost: float) -> ReplicaTerms:
        known = self.snapshots
        count = len(replicas)
        if running_cost == self.running_cost and len(known) == count:
            changed = list(compress(range(count), map(is_not, replicas, known)))
            if not changed:
                return self
            if all(replicas[i].replica_id == known[i].replica_id for i in changed):
                for index in changed:
                    known[index] = replicas[index]
                self._fill(changed)
                return self
        # Another running cost, fleet or order: start over.
        ids = [s.replica_id for s in replicas]
        if ids != [s.replica_id for s in known]:
            self.fleet_version += 1
        self.running_cost = running_cost
        self.snapshots = list(replicas)
        self.cost_terms = [_NO_TERMS] * count
        self.waits = [0.0] * count
        self.backlogs = [0.0] * count
        self.attention = [(0.0, 0.0)] * count
        self.position = {s.replica_id: i for i, s in enumerate(self.snapshots)}
        self.attention_above = math.inf
        self._fill(range(count))
        return self

    def _fill(self, indices: Iterable[int]) -> None:
        """The terms of the snapshots at ``indices``: ``explain``'s step model, inlined (this
        runs for every replica when the fleet changes, so no call per replica)."""
        snapshots = self.snapshots
        cost_terms, waits, backlogs = self.cost_terms, self.waits, self.backlogs
        attention = self.attention
        min_share, ext, running_cost = self.min_share, self.ext, self.running_cost
        for index in indices:
            snapshot = snapshots[index]
            capacity = snapshot.capacity
            rate = capacity.prefill_tokens_per_s
            budget = capacity.max_batch_tokens
            if not (rate > 0 and budget > 0):
                capacity = _sane(snapshot).capacity  # a zero in a report: clamp, do not divide
                rate, budget = capacity.prefill_tokens_per_s, capacity.max_batch_tokens
            token_s = 1.0 / rate
            running = snapshot.running_requests
            decode_step_s = capacity.decode_step_s + running * running_cost * token_s
            if capacity.kv_read_s_per_block:
                decode_step_s += snapshot.active_kv_blocks * capacity.kv_read_s_per_block
            chunk: float = budget - running
            if chunk < min_share * budget:
                chunk = min_share * budget
            per_token = decode_step_s / chunk
            pending = snapshot.pending_prefill_tokens
            waiting = snapshot.queued_requests
            if pending > 0:
                backlog_s = pending * (token_s + per_token)
                if snapshot.pending_attention_s > 0:
                    backlog_s += snapshot.pending_attention_s
                wait = 0.5 * decode_step_s + backlog_s
                if waiting <= 0:
                    waiting = 1  # a running prefill
            else:
                backlog_s = 0.0
                wait = 0.5 * decode_step_s if running > 0 else 0.0
                if waiting < 0:
                    waiting = 0
            delay = waiting * ext * token_s
            cost_terms[index] = (
                chunk,
                wait + decode_step_s,
                token_s,
                delay,
                per_token,
                wait + delay * chunk,
            )
            waits[index] = wait
            backlogs[index] = backlog_s
            per_pair = capacity.attn_s_per_token_pair
            attention[index] = (per_pair, 0.5 * budget)
            if per_pair > 0 and 0.5 * budget < self.attention_above:
                self.attention_above = 0.5 * budget


_NO_TERMS: CostTerms = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _sane(snapshot: ReplicaSnapshot) -> ReplicaSnapshot:
    capacity = snapshot.capacity
    return replace(
        snapshot,
        capacity=replace(
            capacity,
            prefill_tokens_per_s=max(capacity.prefill_tokens_per_s, TINY_RATE),
            max_batch_tokens=max(capacity.max_batch_tokens, 1),
            decode_step_s=max(capacity.decode_step_s, TINY_STEP_S),
        ),
    )


def candidate_costs(
    terms: ReplicaTerms,
    uncached_at: list[int],
    load_at: list[float] | None,
    prompt: int,
    priced: float,
) -> list[float]:
    """Each candidate's cost from its request-independent terms, the tokens it computes and
    what it loads, at ``priced`` (1 + the work price) per second of compute."""
    # One pass in a comprehension: the per-replica terms are folded so that the cost is
    # linear in the tokens computed there, in one step (u <= chunk) or in chunks.
    costs = [
        fixed + u * (priced * token_s + delay)
        if u <= chunk
        else chunked + u * (per + priced * token_s)
        for (chunk, fixed, token_s, delay, per, chunked), u in zip(
            terms.cost_terms, uncached_at, strict=True
        )
    ]
    if load_at is not None:
        costs = [cost + load for cost, load in zip(costs, load_at, strict=True)]
    if prompt > terms.attention_above:  # attention adds to both the TTFT and the work
        # ``prefill_attention_s``, inlined: (per pair, half the budget) per replica.
        for index, (per_pair, half_budget) in enumerate(terms.attention):
            if per_pair > 0:
                u = uncached_at[index]
                pairs = u * (prompt - 0.5 * u - half_budget)
                if pairs > 0:
                    costs[index] += priced * per_pair * pairs
    return costs
