"""Estimated time to first token of a request on each candidate replica.

    ttft = queue wait + prefill of the tokens the replica does not hold + load of the blocks it
           holds in a lower tier

All three terms come from the replica's own ``ReplicaCapacity``, so a tensor-parallel replica
that prefills twice as fast is credited for it, and from its snapshot (work already routed to
it). The hit says what it holds (``view.hits``, confirmed or speculative).

Continuous batching. With chunked prefill (vLLM V1) every engine step first schedules one token
for each running request's decode, then fills the rest of its token budget
(``max_batch_tokens``) with prefill. A step lasts at least ``decode_step_s`` (reading weights and
KV is memory bound) and at least the time to compute a full budget at the peak rate, budget /
``prefill_tokens_per_s``. Prefill therefore advances (budget - running) tokens per step of
max(decode_step_s, budget / peak) seconds: that is the replica's *effective* prefill rate while
its running requests decode, and both the queue (``pending_prefill_tokens``) and the new
prompt's uncached tokens drain at it. The first token needs at least one step.

Lower tiers. A block held in CPU memory or on disk costs its load time
(``cpu_load_s_per_block``, ``disk_load_s_per_block``). When the replica reports none (0), the
hit is credited instead, as Dynamo does: a CPU block saves 0.75 of its prefill and a disk block
0.25 (``cpu_fallback_credit``, ``disk_fallback_credit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from prefixmesh.cache_registry.types import PrefixHit, ReplicaId
from prefixmesh.router.policy.base import ReplicaCapacity, ReplicaSnapshot, RouteRequest

_TINY_RATE = 1e-9
"""Stands in for a zero or negative rate in a snapshot, so a broken report cannot divide by
zero: such a replica just looks hopelessly slow."""


def effective_prefill_rate(
    capacity: ReplicaCapacity, running_requests: int, min_prefill_share: float
) -> float:
    """Prompt tokens per second a replica prefills while ``running_requests`` decode beside it.

    (budget - running) prefill tokens per step of max(decode_step_s, budget / peak) seconds;
    never less than ``min_prefill_share`` of the budget per step (vLLM keeps admitting prefill
    chunks even when decodes fill the budget, just slowly).
    """
    budget = capacity.max_batch_tokens if capacity.max_batch_tokens > 0 else 1
    peak = capacity.prefill_tokens_per_s
    if peak < _TINY_RATE:
        peak = _TINY_RATE
    step_s = budget / peak
    if capacity.decode_step_s > step_s:
        step_s = capacity.decode_step_s
    prefill_per_step = budget - running_requests
    floor = min_prefill_share * budget
    if prefill_per_step < floor:
        prefill_per_step = floor
    return prefill_per_step / step_s


Holder = tuple[int, PrefixHit, float, int]
"""A candidate with a hit: (its index in the snapshot list, the hit, its effective prefill
rate, the prompt tokens it would still compute). A plain tuple: the hot loop builds one per
holder, and a hot prefix can have dozens."""


@dataclass(frozen=True, slots=True)
class CandidateEstimates:
    """Per-candidate estimates, index-aligned with the snapshot list."""

    queue_wait_s: list[float]
    """Time to drain the prefill already routed to the replica."""
    cost: list[float]
    """What the policy minimises: TTFT + recompute_penalty x (seconds of prefill it computes)."""
    holders: list[Holder]
    """Every candidate with a hit, in candidate order (usually a handful)."""
    any_speculative: bool = False
    """Some holder's hit includes speculative (in-flight) blocks."""


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """One candidate's estimate, term by term (``TtftModel.explain``)."""

    prefill_rate: float
    queue_wait_s: float
    uncached_tokens: int
    prefill_s: float
    load_s: float
    ttft_s: float
    cost: float


class TtftModel:
    def __init__(
        self,
        *,
        block_size: int,
        min_prefill_share: float,
        cpu_fallback_credit: float,
        disk_fallback_credit: float,
        recompute_penalty: float,
    ) -> None:
        if min_prefill_share <= 0:
            raise ValueError(f"min_prefill_share must be > 0, got {min_prefill_share}")
        self.block_size = block_size
        self.min_prefill_share = min_prefill_share
        self.cpu_fallback_credit = cpu_fallback_credit
        self.disk_fallback_credit = disk_fallback_credit
        self.recompute_penalty = recompute_penalty

    def held(
        self, hit: PrefixHit, capacity: ReplicaCapacity, key_blocks: int
    ) -> tuple[float, float]:
        """(prompt tokens the hit saves, seconds to load its lower-tier blocks).

        A hit longer than the prompt's full blocks is trimmed from its deepest tier first.
        """
        _, cpu, disk = hit.blocks_by_tier
        gpu = hit.num_blocks - cpu - disk
        if gpu < 0:
            gpu = 0
        excess = gpu + cpu + disk - key_blocks
        if excess > 0:
            for_disk = min(disk, excess)
            disk -= for_disk
            excess -= for_disk
            for_cpu = min(cpu, excess)
            cpu -= for_cpu
            gpu -= excess - for_cpu
        saved_blocks = float(gpu)
        load_s = 0.0
        if cpu > 0:
            if capacity.cpu_load_s_per_block > 0:
                saved_blocks += cpu
                load_s += cpu * capacity.cpu_load_s_per_block
            else:
                saved_blocks += cpu * self.cpu_fallback_credit
        if disk > 0:
            if capacity.disk_load_s_per_block > 0:
                saved_blocks += disk
                load_s += disk * capacity.disk_load_s_per_block
            else:
                saved_blocks += disk * self.disk_fallback_credit
        return saved_blocks * self.block_size, load_s

    def uncached(self, request: RouteRequest, saved_tokens: float) -> int:
        """Prompt tokens left to compute; vLLM always computes the last one."""
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        left = int(prompt - saved_tokens + 0.5)
        least = 1 if prompt else 0
        return left if left > least else least

    def explain(
        self, request: RouteRequest, snapshot: ReplicaSnapshot, hit: PrefixHit | None
    ) -> ReplicaEstimate:
        """The estimate of one candidate, term by term (what ``estimate`` computes in bulk)."""
        capacity = snapshot.capacity
        rate = effective_prefill_rate(capacity, snapshot.running_requests, self.min_prefill_share)
        wait = max(snapshot.pending_prefill_tokens, 0) / rate
        saved, load_s = (0.0, 0.0)
        if hit is not None and hit.num_blocks > 0:
            saved, load_s = self.held(hit, capacity, len(request.key.block_hashes))
        uncached = self.uncached(request, saved)
        compute_s = uncached / rate
        prefill_s = max(compute_s, capacity.decode_step_s)
        ttft = wait + prefill_s + load_s
        return ReplicaEstimate(
            prefill_rate=rate,
            queue_wait_s=wait,
            uncached_tokens=uncached,
            prefill_s=prefill_s,
            load_s=load_s,
            ttft_s=ttft,
            cost=ttft + self.recompute_penalty * compute_s,
        )

    def estimate(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        hits: Mapping[ReplicaId, PrefixHit],
    ) -> CandidateEstimates:
        """``explain`` for every candidate, fast (the routing hot path)."""
        try:
            return self._estimate(request, replicas, hits)
        except ZeroDivisionError:  # a zero rate or budget in some report: clamp, then redo
            return self._estimate(request, [_sane(s) for s in replicas], hits)

    def _estimate(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        hits: Mapping[ReplicaId, PrefixHit],
    ) -> CandidateEstimates:
        # NOTE: this loop runs for every candidate of every request and must stay well under
        # 50 us at 64 replicas, so ``effective_prefill_rate`` and the common kinds of hit (all
        # GPU, or GPU + CPU credited) are inlined, the rate is unclamped (a zero divides, and
        # ``estimate`` retries with clamped snapshots) and nothing but a tuple per holder is
        # allocated. tests/unit/router/policy/test_ttft.py checks it against ``explain``.
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        least_uncached = 1 if prompt else 0  # vLLM always computes the last token
        key_blocks = len(request.key.block_hashes)
        block_size = self.block_size
        cpu_discount = 1.0 - self.cpu_fallback_credit
        min_share = self.min_prefill_share
        penalty = self.recompute_penalty
        hits_get = hits.get if hits else None
        waits: list[float] = []
        costs: list[float] = []
        holders: list[Holder] = []
        any_speculative = False
        add_wait = waits.append
        add_cost = costs.append
        for index, snapshot in enumerate(replicas):
            capacity = snapshot.capacity
            budget = capacity.max_batch_tokens
            decode_step_s = capacity.decode_step_s
            step_s = budget / capacity.prefill_tokens_per_s
            if decode_step_s > step_s:
                step_s = decode_step_s
            prefill_per_step = budget - snapshot.running_requests
            if prefill_per_step < min_share * budget:
                prefill_per_step = min_share * budget
            rate = prefill_per_step / step_s
            pending = snapshot.pending_prefill_tokens
            wait = pending / rate if pending > 0 else 0.0
            add_wait(wait)
            if hits_get is None or (hit := hits_get(snapshot.replica_id)) is None:
                compute_s = prompt / rate
                add_cost(
                    wait
                    + (compute_s if compute_s > decode_step_s else decode_step_s)
                    + penalty * compute_s
                )
                continue
            held_blocks = hit.num_blocks
            _, cpu, disk = hit.blocks_by_tier
            load_s = 0.0
            if (
                held_blocks <= key_blocks
                and not disk
                and (not cpu or (cpu <= held_blocks and capacity.cpu_load_s_per_block <= 0))
            ):
                saved = (held_blocks - cpu * cpu_discount) * block_size
            else:
                saved, load_s = self.held(hit, capacity, key_blocks)
            uncached = int(prompt - saved + 0.5)
            if uncached < least_uncached:
                uncached = least_uncached
            if held_blocks > 0:
                holders.append((index, hit, rate, uncached))
                if hit.num_speculative > 0:
                    any_speculative = True
            compute_s = uncached / rate
            add_cost(
                wait
                + (compute_s if compute_s > decode_step_s else decode_step_s)
                + load_s
                + penalty * compute_s
            )
        return CandidateEstimates(waits, costs, holders, any_speculative)


def _sane(snapshot: ReplicaSnapshot) -> ReplicaSnapshot:
    capacity = snapshot.capacity
    return replace(
        snapshot,
        capacity=replace(
            capacity,
            prefill_tokens_per_s=max(capacity.prefill_tokens_per_s, _TINY_RATE),
            max_batch_tokens=max(capacity.max_batch_tokens, 1),
        ),
    )
