"""prefixmesh's own routing policy: estimated TTFT, a per-candidate overload guard, affinity
groups for hot prefixes, delay-hit holds, and a randomised pick among near-best replicas.

One decision, in order:

1. Estimate every candidate (``ttft.py``): queue wait, TTFT and cost = TTFT + a penalty on the
   prefill the replica would recompute (recomputed work delays everything queued behind it,
   the more so the longer the queues: it grows with the least-loaded replica's backlog).
2. Overload guard, per candidate: a replica whose queue wait exceeds the least-loaded
   candidate's by more than ``overload_wait_s`` (and ``overload_wait_rel`` times, so that a
   fleet-wide backlog does not force recomputes) is skipped. Nothing is switched off fleet-wide:
   one hot replica loses only its own excess traffic (vllm-project/router#238), and a request
   pushed off its holder still goes where the estimate is best among the rest, which favours
   the longest remaining match because held blocks cost no prefill (sgl-project/sglang#32195:
   rebalancing must not discard affinity).
3. Delay-hit deferral: if a candidate holds the prompt speculatively (the router just sent a
   request with this prefix there, whose prefill is probably running now), at least
   ``hold_min_tokens`` beyond anything confirmed anywhere, the guard keeps it and its estimate
   is near-best, the request goes there with a ``Hold``: the replica waits for those blocks
   instead of computing them a second time in the same batch. (Near-best: a burst of siblings
   must not queue on one replica while computing the prefix elsewhere would be faster.)
4. Affinity groups (``affinity.py``): a hot group (k >= 2) is served by its k replicas on a
   consistent-hash ring of the current fleet; it spills outside when the guard rejects all k,
   or when even its best member is ``affinity_slack_s`` dearer than the best replica. A cold
   group (k == 1) is not pinned: pinning every cold prefix to a ring replica is prefix hashing
   again, with its hot spots. The estimate alone keeps a cold prefix on its holder.
5. Pick at random among candidates within ``near_best_rel`` / ``near_best_abs_s`` of the best
   cost, so routers working from the same stale load report do not all pick one replica
   (ai-dynamo/dynamo#589). The ranking then lists the other candidates by cost; replicas that
   are not candidates (overloaded, or outside a hot group) are left out, and if every one of
   them refuses, the adapter asks again with fresh load, as Ray Serve's routers do.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from operator import attrgetter

from prefixmesh.cache_registry.types import BlockHash, ReplicaId
from prefixmesh.config import PrefixmeshPolicyConfig
from prefixmesh.router.policy.affinity import AffinityGroups
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.load import require_replicas
from prefixmesh.router.policy.ring import ReplicaRing
from prefixmesh.router.policy.ttft import CandidateEstimates, Holder, TtftModel

_REFERENCE_REFRESH = 64
"""Decisions between refreshes of the fleet's average replica (``traffic_weight``'s unit):
capacity changes slowly, and a full pass over the fleet per decision would cost ~3 us."""


_replica_id = attrgetter("replica_id")  # builds the ranking at C speed


def fleet_reference(replicas: Sequence[ReplicaSnapshot]) -> tuple[float, float]:
    """(mean peak prefill tokens/s, mean decode step s) over the candidates."""
    count = len(replicas)
    peak = sum(s.capacity.prefill_tokens_per_s for s in replicas) / count
    step = sum(s.capacity.decode_step_s for s in replicas) / count
    return peak, step


class PrefixmeshPolicy:
    name = "prefixmesh"

    def __init__(
        self, config: PrefixmeshPolicyConfig, *, rng: random.Random, block_size: int
    ) -> None:
        self.config = config
        self._rng = rng
        self._block_size = block_size
        self._group_blocks = max(1, config.group_tokens // block_size)
        self.model = TtftModel(
            block_size=block_size,
            min_prefill_share=config.min_prefill_share,
            cpu_fallback_credit=config.cpu_fallback_credit,
            disk_fallback_credit=config.disk_fallback_credit,
        )
        self.groups = AffinityGroups(
            target_utilization=config.affinity_target_utilization,
            hysteresis=config.affinity_hysteresis,
            max_groups=config.affinity_max_groups,
        )
        self.ring = ReplicaRing(config.ring_vnodes)
        self._reference: tuple[float, float] | None = None
        """(mean peak prefill tokens/s, mean decode step s) of the fleet at the last decision:
        the "average replica" that ``traffic_weight`` counts busy-seconds of."""
        self._decisions = 0
        self._fleet_backlog_s = 0.0
        """The least-loaded candidate's queued prefill at the previous decision."""
        self._last_decision: tuple[str, int, list[Holder]] | None = None
        """(request id, chosen index, holders) of the last decision, so the adapter's
        ``traffic_weight`` call right after ``route`` weighs the work the chosen replica does."""

    # ---- groups and their traffic ------------------------------------------------------------

    def prefix_group(self, request: RouteRequest) -> BlockHash | None:
        """The hash of block ``group_tokens // block_size - 1`` (at least the first block): by the
        chain it names the whole head. None for a prompt shorter than the head."""
        hashes = request.key.block_hashes
        if len(hashes) < self._group_blocks:
            return None
        return hashes[self._group_blocks - 1]

    def traffic_weight(self, request: RouteRequest) -> float:
        """The request's work in busy-seconds of an average replica of the fleet.

        Prefill: the tokens its replica must compute (known exactly right after ``route``; else
        the prompt beyond the group head, which the group's members hold). Decode: each output
        token costs one decode step shared by ``decode_batch_size`` requests. 0 before the first
        decision, when nothing is known about the fleet.
        """
        if self._reference is None:
            return 0.0
        peak_rate, decode_step_s = self._reference
        last = self._last_decision
        if last is not None and last[0] == request.request_id:
            _, chosen, holders = last
            prefill_tokens = next(
                (uncached for index, _, _, uncached in holders if index == chosen),
                request.prompt_tokens,
            )
        else:
            head = self._group_blocks * self._block_size
            prefill_tokens = max(request.prompt_tokens - head, min(request.prompt_tokens, 1))
        prefill_s = max(prefill_tokens, 0) / peak_rate if peak_rate > 0 else 0.0
        decode_s = max(request.output_tokens, 0) * decode_step_s / self.config.decode_batch_size
        return prefill_s + max(decode_s, 0.0)

    # ---- the decision ------------------------------------------------------------------------

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        if self._decisions % _REFERENCE_REFRESH == 0:
            self._reference = fleet_reference(replicas)
        self._decisions += 1
        config = self.config
        # Recomputing costs its busy time to everyone queued behind it. While some replica has
        # no queued prefill that is a fraction of a request (recompute_penalty); once even the
        # least-loaded one has a backlog, every second recomputed is paid by a queue of
        # requests, so the price grows with that backlog and affinity wins over a slightly
        # shorter wait. The backlog is the one measured at the previous decision: it moves
        # slowly, and pricing in the same pass saves a second one over the fleet.
        penalty = config.recompute_penalty + self._fleet_backlog_s / config.pressure_wait_s
        estimates = self.model.estimate(request, replicas, view.hits, penalty)
        backlog_s = estimates.least_backlog_s
        self._fleet_backlog_s = backlog_s if backlog_s == backlog_s else 0.0  # NaN: forget
        cost = estimates.cost
        waits = estimates.queue_wait_s
        least_wait = min(waits)
        if least_wait != least_wait:  # NaN in a report: guard nothing
            limit = math.inf
        else:
            # The guard: a replica is overloaded iff its queue wait exceeds the least-loaded
            # candidate's by overload_wait_s AND by the factor overload_wait_rel (SGLang's two
            # thresholds): under a fleet-wide backlog a holder a little further behind keeps
            # its traffic, instead of forcing recomputes that deepen the backlog everywhere.
            limit = max(least_wait + config.overload_wait_s, least_wait * config.overload_wait_rel)
        candidates, reason = self._candidates(request, replicas, view, estimates, cost, limit)
        if not candidates:  # every wait NaN: nothing to compare, anyone will do
            candidates = list(range(len(replicas)))
        order = sorted(candidates, key=cost.__getitem__)  # ties keep candidate order
        best = cost[order[0]]
        near_bound = best + abs(best) * config.near_best_rel + config.near_best_abs_s
        held = None
        if estimates.any_speculative and config.holds_enabled:
            held = self._hold_candidate(request, estimates, cost, limit, near_bound)
        if held is not None:
            # The hold binds to the chosen replica only; the other candidates stay in the
            # ranking as plain fallbacks should the adapter be unable to send it there.
            (chosen, hold), reason = held, "hold"
        else:
            hold = None
            chosen = self._pick_near_best(order, cost, near_bound)
        if order[0] != chosen:
            if chosen in order:
                order.remove(chosen)
            order.insert(0, chosen)  # a held request may go outside its hot group
        self._last_decision = (request.request_id, chosen, estimates.holders)
        ranking = tuple(zip(map(_replica_id, map(replicas.__getitem__, order)), strict=True))
        return RouteDecision(ranking, hold=hold, reason=reason)

    def _candidates(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        estimates: CandidateEstimates,
        cost: list[float],
        limit: float,
    ) -> tuple[list[int], str]:
        """Where the request may go: its hot group's members the guard keeps, else every
        replica the guard keeps; and the reason to report.

        A hot group spills when the guard rejects all its members, and also when its best
        member's cost exceeds the best replica's by more than ``affinity_slack_s``: members
        that are busy with other work must not queue the group while a replica that would
        even recompute the prefix answers sooner (the spill target then holds a copy, and
        the group's rate soon buys it more members).
        """
        waits = estimates.queue_wait_s
        group = self.prefix_group(request) if self.config.affinity_enabled else None
        if group is not None:
            k = min(self.groups.size(group, view.group_rate), len(replicas))
            if k >= 2:
                self.ring.sync(list(map(_replica_id, replicas)))
                inside = [i for i in self.ring.member_positions(group, k) if waits[i] <= limit]
                if max(waits) <= limit:
                    kept, best_kept = list(range(len(waits))), min(cost)
                else:
                    kept = [i for i, wait in enumerate(waits) if wait <= limit]
                    best_kept = min(map(cost.__getitem__, kept))
                if inside and (
                    min(map(cost.__getitem__, inside)) <= best_kept + self.config.affinity_slack_s
                ):
                    return inside, "affinity"
                return kept, "spill"
        if max(waits) <= limit:  # the common case: nobody overloaded
            return list(range(len(waits))), "least_ttft"
        kept = [i for i, wait in enumerate(waits) if wait <= limit]
        if estimates.holders:
            longest = max(hit.num_blocks for _, hit, _, _ in estimates.holders)
            longest_kept = max(
                (hit.num_blocks for i, hit, _, _ in estimates.holders if waits[i] <= limit),
                default=0,
            )
            if longest > longest_kept:  # the guard pushed it off its best holder
                return kept, "overload"
        return kept, "least_ttft"

    def _hold_candidate(
        self,
        request: RouteRequest,
        estimates: CandidateEstimates,
        cost: list[float],
        limit: float,
        near_bound: float,
    ) -> tuple[int, Hold] | None:
        """The replica computing the longest in-flight stretch of the prompt, if worth a hold:
        the guard keeps it and its estimate (in-flight blocks counted as held, its queue with
        the computing request in it) is within the near-best band of the best candidate's.

        The last condition keeps holds from piling a burst of siblings onto one replica while
        others idle: once its queue makes it dearer than computing the prefix elsewhere, the
        next sibling goes elsewhere and that replica's copy becomes the next one to join.
        """
        holders = estimates.holders
        best_confirmed = max(hit.num_blocks - hit.num_speculative for _, hit, _, _ in holders)
        key_blocks = len(request.key.block_hashes)
        block_size = self._block_size
        min_tokens = self.config.hold_min_tokens
        waits = estimates.queue_wait_s
        best: Holder | None = None
        best_blocks = 0
        for holder in holders:
            index, hit, _, _ = holder
            if hit.num_speculative <= 0 or not waits[index] <= limit or cost[index] > near_bound:
                continue
            blocks = min(hit.num_blocks, key_blocks)
            if blocks <= best_confirmed or (blocks - best_confirmed) * block_size < min_tokens:
                continue
            if (
                best is None
                or blocks > best_blocks
                or (blocks == best_blocks and cost[index] < cost[best[0]])
            ):
                best, best_blocks = holder, blocks
        if best is None:
            return None
        index, hit, per_token_s, _ = best
        in_flight_blocks = min(hit.num_speculative, best_blocks)
        # The blocks are stored once the request computing them gets through the replica's
        # queue (which includes that request's own prefill) and computes them: bound the wait
        # by the larger of the two, times a safety factor. The replica releases the hold as
        # soon as the blocks land, so a generous bound costs nothing when all goes well.
        in_flight_prefill_s = in_flight_blocks * block_size * per_token_s
        expected_s = max(waits[index], in_flight_prefill_s, 0.0)
        hold = Hold(num_blocks=best_blocks, max_wait_s=self.config.hold_wait_factor * expected_s)
        return index, hold

    def _pick_near_best(self, order: list[int], cost: list[float], bound: float) -> int:
        """A random one of the candidates within the near-best band (``order``: by cost)."""
        near = 1
        while near < len(order) and cost[order[near]] <= bound:
            near += 1
        return order[0] if near == 1 else order[self._rng.randrange(near)]

    # ---- hooks -------------------------------------------------------------------------------

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        """Nothing to record: the adapter writes the speculative entry and touches the group,
        and the next snapshot carries the replica's load."""

    def on_finished(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        return None

    def on_replica_removed(self, replica: ReplicaId) -> None:
        """The ring follows the candidate list at the next hot-group decision."""
