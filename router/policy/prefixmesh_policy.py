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
from collections import deque
from collections.abc import Mapping, Sequence
from operator import attrgetter

from prefixmesh.cache_registry.hashing import shared_blocks
from prefixmesh.cache_registry.types import BlockHash, PrefixHit, ReplicaId
from prefixmesh.config import PrefixmeshPolicyConfig
from prefixmesh.router.policy.affinity import AffinityGroups
from prefixmesh.router.policy.base import (
    Hold,
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.decode_cost import DecodeCost
from prefixmesh.router.policy.load import require_replicas
from prefixmesh.router.policy.ring import ReplicaRing
from prefixmesh.router.policy.ttft import CandidateEstimates, TtftModel

_REFERENCE_REFRESH = 64
"""Decisions between refreshes of the fleet's average replica (``traffic_weight``'s unit):
capacity changes slowly, and a full pass over the fleet per decision would cost ~3 us."""


_RUNNING_COST_STEP = 0.01
"""Relative change of the learned running cost (``DecodeCost``) that the estimate follows."""

_GROUP_PROMPTS = 2
"""Recent prompts kept per hot group: its shared prefix is what the next one has in common
with all of them."""

_replica_id = attrgetter("replica_id")

InFlight = tuple[tuple[BlockHash, ...], int, float]
"""A prompt a replica was sent to compute: (its block hashes, the first block it computes, when
its first token, and so its blocks, should be ready)."""


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
            queue_externality=config.queue_externality,
        )
        self.groups = AffinityGroups(
            target_utilization=config.affinity_target_utilization,
            hysteresis=config.affinity_hysteresis,
            max_groups=config.affinity_max_groups,
            rate_half_life_s=config.affinity_rate_half_life_s,
            max_warmup_boost=config.affinity_warmup_max_boost,
            min_requests=config.affinity_min_requests,
        )
        self.ring = ReplicaRing(config.ring_vnodes)
        self._ring_version = -1
        """The fleet version (``TtftModel.prepare``) the ring was last synced to."""
        self._reference: tuple[float, float] | None = None
        """(mean peak prefill tokens/s, mean decode step s) of the fleet at the last decision:
        the "average replica" that ``traffic_weight`` counts busy-seconds of."""
        self._decisions = 0
        self._fleet_backlog_s = 0.0
        """The least-loaded candidate's queued prefill at the previous decision."""
        self._last_decision: tuple[str, int] | None = None
        """(request id, tokens the chosen replica computes) of the last decision, so the
        adapter's ``traffic_weight`` call right after ``route`` weighs the work done there."""
        self.decode_cost = (
            DecodeCost(
                window=config.decode_cost_window,
                max_cost=config.decode_cost_max,
                min_output_tokens=config.decode_cost_min_output_tokens,
                max_tracked=config.decode_cost_max_tracked,
            )
            if config.decode_cost_window > 0
            else None
        )
        self._memory_size = config.hold_memory
        self._group_prompts: dict[BlockHash, deque[tuple[BlockHash, ...]]] = {}
        """Per hot group, its last prompts' block hashes (what ``_credit`` compares with)."""
        self._in_flight: dict[ReplicaId, deque[InFlight]] = {}
        """Per replica, the last prompts it was sent to compute (at least ``hold_min_tokens``):
        what a sibling's hold there waits for, and when it should be ready."""

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
        token costs its share of a decode step's fixed part (shared by ``decode_batch_size``
        requests) plus what a running request adds to every step (the learned running cost, in
        token computes: ``decode_cost.py``). 0 before the first decision, when nothing is known
        about the fleet.
        """
        if self._reference is None:
            return 0.0
        peak_rate, decode_step_s = self._reference
        last = self._last_decision
        if last is not None and last[0] == request.request_id:
            prefill_tokens = last[1]
        else:
            head = self._group_blocks * self._block_size
            prefill_tokens = max(request.prompt_tokens - head, min(request.prompt_tokens, 1))
        prefill_s = max(prefill_tokens, 0) / peak_rate if peak_rate > 0 else 0.0
        per_token_s = decode_step_s / self.config.decode_batch_size
        if peak_rate > 0:
            per_token_s += self.model.running_cost / peak_rate
        decode_s = max(request.output_tokens, 0) * per_token_s
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
        price = config.recompute_penalty + self._fleet_backlog_s / config.pressure_wait_s
        if self.decode_cost is not None:
            learned = self.decode_cost.value
            # Moves of under 1% are noise in the estimate; ignoring them keeps the model's
            # per-snapshot terms (``TtftModel.estimate``) valid across decisions.
            if abs(learned - self.model.running_cost) > _RUNNING_COST_STEP * learned:
                self.model.running_cost = learned
        fleet_version = self.model.prepare(replicas)
        members = self._members(request, replicas, view, now_s, fleet_version)
        credit = None if members is None else self._credit(request, view.hits, members)
        estimates = self.model.estimate(
            request, replicas, view.hits, price, credit, view.shared_blocks
        )
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
        candidates, reason = self._candidates(replicas, view.hits, estimates, limit, members)
        # One sort of the candidates by cost gives the best one, the near-best band (a prefix
        # of the order) and the ranking.
        if candidates is None:
            order = sorted(range(len(cost)), key=cost.__getitem__)
        else:
            if not candidates:  # every wait NaN: nothing to compare, anyone will do
                candidates = list(range(len(replicas)))
            order = sorted(candidates, key=cost.__getitem__)
        best_cost = cost[order[0]]
        near_bound = best_cost + abs(best_cost) * config.near_best_rel + config.near_best_abs_s
        held = None
        if estimates.any_speculative and config.holds_enabled:
            held = self._hold_candidate(request, replicas, estimates, near_bound, now_s)
        ready_s = 0.0
        if held is not None:
            # The hold binds to the chosen replica only; the other candidates stay in the
            # ranking as plain fallbacks should the adapter be unable to send it there.
            (chosen, hold, ready_s), reason = held, "hold"
        else:
            hold = None
            chosen = self._pick_near_best(replicas, order, cost, near_bound)
        uncached = self._uncached(request, replicas[chosen], view)
        ttft_s = self._note(request, replicas[chosen], waits[chosen], uncached, hold is None, now_s)
        self._last_decision = (request.request_id, uncached)
        ranked = self._ranking(replicas, order, chosen)
        # A held request's first token comes no sooner than the blocks it waits for.
        return RouteDecision(ranked, hold, reason, ttft_s if ttft_s > ready_s else ready_s)

    def _ranking(
        self, replicas: Sequence[ReplicaSnapshot], order: list[int], chosen: int
    ) -> tuple[tuple[ReplicaId, ...], ...]:
        """The chosen replica, then the next ``ranking_depth - 1`` candidates by cost."""
        top = order[: self.config.ranking_depth]
        if top[0] != chosen:
            if chosen in top:
                top.remove(chosen)
            elif len(top) == self.config.ranking_depth:
                top.pop()
            top.insert(0, chosen)  # a held request may go outside its hot group
        return tuple([(replicas[i].replica_id,) for i in top])

    def _uncached(
        self, request: RouteRequest, snapshot: ReplicaSnapshot, view: RegistryView
    ) -> int:
        """Prompt tokens the replica will compute (by what the registry says it and the
        shared tier hold)."""
        hit = view.hits.get(snapshot.replica_id) if view.hits else None
        if hit is None or hit.num_blocks <= 0:
            uncached = max(request.prompt_tokens, 0)
        else:
            saved, _ = self.model.held(hit, snapshot.capacity, len(request.key.block_hashes))
            uncached = self.model.uncached(request, saved)
        model = self.model
        return model.with_shared(request, snapshot.capacity, uncached, view.shared_blocks)[0]

    def _candidates(
        self,
        replicas: Sequence[ReplicaSnapshot],
        hits: Mapping[ReplicaId, PrefixHit],
        estimates: CandidateEstimates,
        limit: float,
        members: tuple[int, ...] | None,
    ) -> tuple[list[int] | None, str]:
        """Where the request may go: its hot group's members and other holders of the group
        head that the guard keeps, else every replica the guard keeps (None: every replica);
        and the reason to report.

        A hot group spills when the guard rejects all of those, and also when the best of them
        costs more than the best replica by ``affinity_slack_s``: members that are busy with
        other work must not queue the group while a replica that would even recompute the
        prefix answers sooner (the spill target then holds a copy, and the group's rate soon
        buys it more members). Holders outside the members stay candidates: their copy exists
        already, and only new copies are kept within the members (bounded replication).
        """
        waits = estimates.queue_wait_s
        cost = estimates.cost
        nobody_overloaded = max(waits) <= limit
        if members is not None:
            if nobody_overloaded:  # every member and holder passes the guard
                inside = list(members)
            else:
                inside = [i for i in members if waits[i] <= limit]
            head = self._group_blocks
            member_set = None
            for index, hit, _ in estimates.holders:
                if hit.num_blocks >= head and (nobody_overloaded or waits[index] <= limit):
                    if member_set is None:
                        member_set = set(members)
                    if index not in member_set:
                        inside.append(index)
            if nobody_overloaded:
                kept, best_kept = None, min(cost)
            else:
                kept = [i for i, wait in enumerate(waits) if wait <= limit]
                best_kept = min(map(cost.__getitem__, kept))
            if inside and (
                min(map(cost.__getitem__, inside)) <= best_kept + self.config.affinity_slack_s
            ):
                return inside, "affinity"
            return kept, "spill"
        if nobody_overloaded:  # the common case
            return None, "least_ttft"
        kept = [i for i, wait in enumerate(waits) if wait <= limit]
        if estimates.holders:
            longest = max(hit.num_blocks for _, hit, _ in estimates.holders)
            longest_kept = max(
                (hit.num_blocks for i, hit, _ in estimates.holders if waits[i] <= limit),
                default=0,
            )
            if longest > longest_kept:  # the guard pushed it off its best holder
                return kept, "overload"
        return kept, "least_ttft"

    # ---- affinity groups ---------------------------------------------------------------------

    def _members(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
        fleet_version: int,
    ) -> tuple[int, ...] | None:
        """Positions of the request's hot group's k ring members (None: no hot group)."""
        if not self.config.affinity_enabled:
            return None
        hashes = request.key.block_hashes
        if len(hashes) < self._group_blocks:
            return None
        group = hashes[self._group_blocks - 1]  # prefix_group, inlined
        groups = self.groups
        k = groups.size(group, groups.observed(group, view.group_rate, now_s))
        if k < 2 or len(replicas) < 2:
            return None
        if k > len(replicas):
            k = len(replicas)
        ring = self.ring
        if fleet_version != self._ring_version:  # the candidates' ids or order changed
            ring.sync(tuple(map(_replica_id, replicas)))
            self._ring_version = fleet_version
        return ring.member_positions(group, k)

    def _credit(
        self, request: RouteRequest, hits: Mapping[ReplicaId, PrefixHit], members: tuple[int, ...]
    ) -> tuple[tuple[int, ...], int] | None:
        """Credit every member with the group's shared prefix: the longest run of blocks some
        replica holds confirmed, but no deeper than this prompt shares with the group's last
        prompts (None: nothing to credit).

        The group's rate bought it k replicas; a member that has no copy yet gets one from the
        next request sent there, which is therefore not charged for computing it: members
        compete on load, as in the survey's affinity groups, and a hot prefix spreads before
        its holders queue up instead of after (a greedy TTFT estimate only copies a prefix
        once its holders are slower than a full recompute). Only what the group's prompts
        share is credited: a run one replica holds deeper than that is this prompt's own
        history (a conversation, Mooncake's sessions), which other members would recompute."""
        group_blocks = self._group_blocks
        hashes = request.key.block_hashes
        group = hashes[group_blocks - 1]
        recent = self._group_prompts.get(group)
        if recent is None:
            recent = self._group_prompts[group] = deque(maxlen=_GROUP_PROMPTS)
            if len(self._group_prompts) > self.config.affinity_max_groups:
                del self._group_prompts[next(iter(self._group_prompts))]
        shared = len(hashes)
        for other in recent:
            shared = shared_blocks(hashes, other, shared)
        recent.append(hashes)
        if len(recent) < 2 or shared < group_blocks:
            return None
        # Credited only as far as some replica holds it confirmed: the longest such run, when
        # it is shorter (the scan stops at the first holder of the whole shared part).
        longest = 0
        for hit in hits.values():
            confirmed = hit.num_blocks - hit.num_speculative
            if confirmed >= shared:
                longest = shared
                break
            if confirmed > longest:
                longest = confirmed
        if longest < group_blocks:
            return None
        return members, longest

    # ---- delay-hit deferral ------------------------------------------------------------------

    def _note(
        self,
        request: RouteRequest,
        snapshot: ReplicaSnapshot,
        wait_s: float,
        uncached: int,
        computes: bool,
        now_s: float,
    ) -> float:
        """Record what the decision expects of the chosen replica: when the request's first
        token should come (the decode-cost sample, ``DecodeCost``) and, if it computes at least
        ``hold_min_tokens`` of its prompt there, that the replica is computing it until then:
        the in-flight mark a later sibling's hold is priced by (Strata's transient node, at
        the router). Returns that time to the first token."""
        # Comparisons instead of max(): this runs once per decision, on the hot path.
        capacity = snapshot.capacity
        rate = capacity.prefill_tokens_per_s
        token_s = 1.0 / rate if rate > 0 else 0.0
        running = snapshot.running_requests
        if running < 0:
            running = 0
        fixed_step_s = (
            capacity.decode_step_s + snapshot.active_kv_blocks * capacity.kv_read_s_per_block
        )
        decode_step_s = fixed_step_s + running * self.model.running_cost * token_s
        budget = capacity.max_batch_tokens
        chunk: float = budget - running
        if self.config.min_prefill_share * budget > chunk:
            chunk = self.config.min_prefill_share * budget
        if chunk < 1.0:
            chunk = 1.0
        steps = uncached / chunk
        # The step model's own prefill (ttft.py): one step, or chunk-sized ones.
        ttft_s = wait_s + uncached * token_s + decode_step_s * (steps if steps > 1.0 else 1.0)
        if capacity.attn_s_per_token_pair > 0:
            ttft_s += capacity.prefill_attention_s(request.prompt_tokens, uncached)
        if self.decode_cost is not None:
            self.decode_cost.routed(
                request.request_id,
                now_s,
                ttft_s,
                fixed_step_s,
                (running + 1) * token_s,
                request.output_tokens,
            )
        if not computes or uncached < max(self.config.hold_min_tokens, 1):
            return ttft_s
        if not self._memory_size or not ttft_s < math.inf:
            return ttft_s
        memory = self._in_flight.get(snapshot.replica_id)
        if memory is None:
            memory = self._in_flight[snapshot.replica_id] = deque(maxlen=self._memory_size)
        hashes = request.key.block_hashes
        first_block = max(0, len(hashes) - -(-uncached // self._block_size))
        memory.append((hashes, first_block, now_s + ttft_s))
        return ttft_s

    def _ready_in(
        self, replica: ReplicaId, hashes: tuple[BlockHash, ...], blocks: int, now_s: float
    ) -> float | None:
        """Seconds until the replica stores block ``blocks - 1`` of this prompt, by the in-flight
        mark of the request computing it (None: no mark; another router sent it)."""
        memory = self._in_flight.get(replica)
        if not memory:
            return None
        position = blocks - 1
        block = hashes[position]
        for theirs, first_block, ready_s in reversed(memory):
            if first_block <= position < len(theirs) and theirs[position] == block:
                return ready_s - now_s if ready_s > now_s else 0.0
        return None

    def _hold_candidate(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        estimates: CandidateEstimates,
        near_bound: float,
        now_s: float,
    ) -> tuple[int, Hold, float] | None:
        """The replica computing the longest in-flight stretch of the prompt, if worth a hold,
        with the hold and the seconds until the blocks it waits for should land.

        A held request waits for the blocks, then joins at the head of that replica's queue:
        its TTFT is the time until they land plus one step for the rest of its prompt, whatever
        else is queued there. When is "until they land"? The router remembers when it expected
        the computing request's first token (``_remember``); without that mark (another router
        sent it), the replica's whole queue wait bounds it. The hold is taken when that TTFT,
        priced like any other candidate (work, delay to others), is within the near-best band
        of the best alternative, which pays for recomputing the prefix: under load a hold that
        saves a whole prefill wins even against an idle replica.
        """
        holders = estimates.holders
        best_confirmed = max(hit.num_blocks - hit.num_speculative for _, hit, _ in holders)
        hashes = request.key.block_hashes
        key_blocks = len(hashes)
        block_size = self._block_size
        min_tokens = self.config.hold_min_tokens
        waits = estimates.queue_wait_s
        cost = estimates.cost
        best: tuple[int, float, int, float] | None = None
        for index, hit, _ in holders:
            if hit.num_speculative <= 0:
                continue
            blocks = min(hit.num_blocks, key_blocks)
            if blocks <= best_confirmed or (blocks - best_confirmed) * block_size < min_tokens:
                continue
            in_flight_blocks = min(hit.num_speculative, blocks)
            per_token_s = self.model.per_token_s(replicas[index])
            in_flight_tokens = in_flight_blocks * block_size
            attention_s = replicas[index].capacity.prefill_attention_s(
                blocks * block_size, in_flight_tokens
            )
            in_flight_s = in_flight_tokens * per_token_s + attention_s
            wait = waits[index]
            ready = self._ready_in(replicas[index].replica_id, hashes, blocks, now_s)
            if ready is None or not ready < wait:
                ready = wait
            hold_cost = cost[index] - wait + ready
            if not hold_cost <= near_bound:
                continue
            if (
                best is None
                or blocks > best[2]
                or (blocks == best[2] and hold_cost < best[1])
                or (
                    blocks == best[2]
                    and hold_cost == best[1]
                    and replicas[index].replica_id < replicas[best[0]].replica_id
                )
            ):
                best = (index, hold_cost, blocks, max(ready, in_flight_s))
        if best is None:
            return None
        index, _, blocks, expected_s = best
        # The replica releases the hold as soon as the blocks land, so a generous bound costs
        # nothing when all goes well; it only caps the damage of a computing request that
        # failed or fell behind.
        hold = Hold(num_blocks=blocks, max_wait_s=self.config.hold_wait_factor * expected_s)
        return index, hold, expected_s

    def _pick_near_best(
        self,
        replicas: Sequence[ReplicaSnapshot],
        order: list[int],
        cost: list[float],
        bound: float,
    ) -> int:
        """A random one of the candidates within the near-best band (``order``: by cost).

        The band is drawn in replica-id order, not candidate order, so that the choice depends
        only on the policy's seed and the replicas' state: adapters may list the same replicas
        in any order (Serve builds its candidate list from a set of replica ids)."""
        near = 1
        count = len(order)
        while near < count and cost[order[near]] <= bound:
            near += 1
        if near == 1:
            return order[0]
        band = sorted(order[:near], key=lambda i: replicas[i].replica_id)
        return band[self._rng.randrange(near)]

    # ---- hooks -------------------------------------------------------------------------------

    def on_routed(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        """Nothing to record: the adapter writes the speculative entry and touches the group,
        and the next snapshot carries the replica's load."""

    def on_finished(self, request: RouteRequest, replica: ReplicaId, now_s: float) -> None:
        """A step-time sample for the running cost (``DecodeCost``)."""
        if self.decode_cost is not None:
            self.decode_cost.finished(request.request_id, request.output_tokens, now_s)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        """Forget what it was computing; the ring follows the candidate list at the next
        hot-group decision."""
        self._in_flight.pop(replica, None)
