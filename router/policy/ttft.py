"""Estimated time to first token of a request on each candidate replica, and its cost.

    ttft = queue wait + prefill of the tokens the replica does not hold + load of the blocks it
           holds in a lower tier
    cost = ttft + work price x work + queue externality x delay it adds to requests waiting there

Every term comes from the replica's own ``ReplicaCapacity`` and its snapshot, so a tensor-
parallel replica that prefills twice as fast is credited for it, and a replica busy decoding
many long requests is charged for it. The hit says what it holds (``view.hits``, confirmed or
speculative: a block being computed right now is counted as held).

The step model. A continuous-batching engine (vLLM V1, chunked prefill) runs steps; each step
first carries one decode token for every running request, then fills the rest of its token
budget (``max_batch_tokens``) with prefill. Its duration is

    step = decode_step_s                        fixed cost: weights, launches, sampling
         + (R + c) / prefill_tokens_per_s       R decode tokens and c prefill tokens computed
         + K * kv_read_s_per_block              the running requests' K KV blocks read

so with R running requests a step without prefill (the *decode step*) takes
decode_step_s + R / peak + K * kv_read_s_per_block, and a step with a full prefill chunk of
c = budget - R tokens takes c / peak longer. A prefill token thus costs 1 / peak of compute
plus its share of the decode step, decode step / c: the replica's *effective* time per prefill
token, longer on a replica busy decoding.

- queue wait = half a decode step (a busy replica takes the request at its next step
  boundary) + the prefill already routed there (``pending_prefill_tokens``) at the effective
  time per token, plus its attention as the replica reports it (``pending_attention_s``);
- own prefill = its uncached tokens at the effective time per token, but never less than the
  one step that carries them: decode step + uncached / peak; plus, on a long prompt, the
  attention the peak rate does not count (``ReplicaCapacity.prefill_attention_s``, when the
  replica reports ``attn_s_per_token_pair``: the last u of P tokens attend to u * (P - u/2)
  pairs);
- lower tiers: a block held in CPU memory or on disk costs its load time
  (``cpu_load_s_per_block``, ``disk_load_s_per_block``); when the replica reports none (0), the
  hit is credited instead, as Dynamo does: a CPU block saves 0.75 of its prefill, a disk block
  0.25 (``cpu_fallback_credit``, ``disk_fallback_credit``).

The cost adds what the request does to others on that replica, since the goal is the mean TTFT
of everyone, not this request's alone:

- *work*: uncached / peak, busy time spent computing; priced by the caller (``work_price``),
  it delays whatever arrives there next, and recomputing what another replica holds wastes it;
- *queue externality*: the requests already waiting there for their first token (queued, or
  one running prefill when nothing is queued) share a step with the request's first chunk and
  are each delayed by its compute, min(uncached, chunk) / peak. A long prompt thus avoids a
  replica where a short request is about to start, instead of making it wait its whole chunk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

from prefixmesh.cache_registry.types import PrefixHit, ReplicaId
from prefixmesh.router.policy.base import ReplicaCapacity, ReplicaSnapshot, RouteRequest
from prefixmesh.router.policy.ttft_terms import TINY_RATE, ReplicaTerms, candidate_costs


@dataclass(frozen=True, slots=True)
class StepTimes:
    """A replica's engine steps under its current load (see the module docstring)."""

    token_s: float
    """Compute time of one batched token (1 / peak prefill rate)."""
    decode_step_s: float
    """A step carrying only the running requests' decode tokens."""
    prefill_chunk_tokens: float
    """Prefill tokens a step carries beside those decodes."""
    prefill_s_per_token: float
    """Effective time per prefill token: its compute + its share of the decode step."""


def step_times(
    capacity: ReplicaCapacity,
    running_requests: int,
    active_kv_blocks: int,
    min_prefill_share: float,
    running_cost: float = 1.0,
) -> StepTimes:
    """The step model of one replica; the chunk never falls below ``min_prefill_share`` of the
    budget (vLLM keeps admitting prefill chunks when decodes fill the budget, just slowly).
    ``running_cost``: what a running request adds to a step, in units of one token's compute
    (1 when its KV reads are reported separately, more when they are not; ``DecodeCost``)."""
    budget = capacity.max_batch_tokens if capacity.max_batch_tokens > 0 else 1
    peak = capacity.prefill_tokens_per_s
    token_s = 1.0 / (peak if peak > TINY_RATE else TINY_RATE)
    decode_step_s = (
        capacity.decode_step_s
        + running_requests * token_s * running_cost
        + active_kv_blocks * capacity.kv_read_s_per_block
    )
    chunk = max(budget - running_requests, min_prefill_share * budget)
    return StepTimes(token_s, decode_step_s, chunk, token_s + decode_step_s / chunk)


Holder = tuple[int, PrefixHit, int]
"""A candidate with a hit: (its index in the snapshot list, the hit, the prompt tokens it would
still compute). A plain tuple: the hot loop builds one per holder, and a hot prefix can have
dozens."""


@dataclass(frozen=True, slots=True)
class CandidateEstimates:
    """Per-candidate estimates, index-aligned with the snapshot list."""

    queue_wait_s: list[float]
    """Time before the request's own prefill starts there."""
    cost: list[float]
    """TTFT + work price x work + queue externality x delay added to requests waiting there."""
    least_backlog_s: float
    """The shortest queued prefill (pending x effective time per token, plus its reported
    attention) of any candidate: 0 while some replica has none, the fleet's backlog once every
    one has some."""
    holders: list[Holder]
    """Every candidate with a hit, in candidate order (usually a handful)."""
    any_speculative: bool = False
    """Some holder's hit includes speculative (in-flight) blocks."""


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """One candidate's estimate, term by term (``TtftModel.explain``)."""

    steps: StepTimes
    queue_wait_s: float
    uncached_tokens: int
    prefill_s: float
    load_s: float
    ttft_s: float
    work_s: float
    """Compute time of the uncached tokens there (uncached / peak)."""
    waiting_requests: int
    """Requests there still waiting for their first token that the request's first chunk
    delays: those queued, or the running prefill when none is queued."""
    delay_s: float
    """What the request's first chunk adds to each of them: min(uncached, chunk) / peak."""

    def cost(self, work_price: float, queue_externality: float) -> float:
        return (
            self.ttft_s
            + work_price * self.work_s
            + queue_externality * self.waiting_requests * self.delay_s
        )


class TtftModel:
    def __init__(
        self,
        *,
        block_size: int,
        min_prefill_share: float,
        cpu_fallback_credit: float,
        disk_fallback_credit: float,
        queue_externality: float = 0.0,
    ) -> None:
        if min_prefill_share <= 0:
            raise ValueError(f"min_prefill_share must be > 0, got {min_prefill_share}")
        self.block_size = block_size
        self.min_prefill_share = min_prefill_share
        self.cpu_fallback_credit = cpu_fallback_credit
        self.disk_fallback_credit = disk_fallback_credit
        self.queue_externality = queue_externality
        self.running_cost = 1.0
        """Step time a running request adds, in token computes (set from ``DecodeCost``)."""
        self._terms = ReplicaTerms(min_prefill_share, queue_externality)
        self._prepared: Sequence[ReplicaSnapshot] | None = None

    def prepare(self, replicas: Sequence[ReplicaSnapshot]) -> int:
        """Bring the per-snapshot terms up to date for this decision's candidates (the next
        ``estimate`` with this very list skips it); returns the fleet version, which changes
        whenever the candidates' ids or order do (what a ring over them must follow)."""
        self._prepared = replicas
        return self._terms.update(replicas, self.running_cost).fleet_version

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

    def reads_shared_tier(self, capacity: ReplicaCapacity) -> bool:
        """Whether the replica loads the cluster's shared tier rather than computing what it
        holds: it reads it (a load cost it reported) faster than it prefills a block."""
        per_block = capacity.shared_load_s_per_block
        rate = capacity.prefill_tokens_per_s
        return rate > 0 and 0 < per_block < self.block_size / rate

    def with_shared(
        self, request: RouteRequest, capacity: ReplicaCapacity, uncached: int, shared_blocks: int
    ) -> tuple[int, float]:
        """(tokens left to compute, seconds of shared-tier loads) for a replica that would
        compute ``uncached`` tokens on its own, when the shared tier holds the prompt's first
        ``shared_blocks`` blocks: the blocks past its own hit come from there."""
        if shared_blocks <= 0 or not self.reads_shared_tier(capacity):
            return uncached, 0.0
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        blocks = min(shared_blocks, len(request.key.block_hashes))
        left = max(prompt - blocks * self.block_size, 1 if prompt else 0)
        if left >= uncached:
            return uncached, 0.0
        return left, (uncached - left) / self.block_size * capacity.shared_load_s_per_block

    def uncached(self, request: RouteRequest, saved_tokens: float) -> int:
        """Prompt tokens left to compute; vLLM always computes the last one."""
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        left = int(prompt - saved_tokens + 0.5)
        least = 1 if prompt else 0
        return left if left > least else least

    def per_token_s(self, snapshot: ReplicaSnapshot) -> float:
        """The replica's effective time per prefill token now (``StepTimes``)."""
        return step_times(
            snapshot.capacity,
            snapshot.running_requests,
            snapshot.active_kv_blocks,
            self.min_prefill_share,
            self.running_cost,
        ).prefill_s_per_token

    def explain(
        self,
        request: RouteRequest,
        snapshot: ReplicaSnapshot,
        hit: PrefixHit | None,
        shared_blocks: int = 0,
    ) -> ReplicaEstimate:
        """The estimate of one candidate, term by term (what ``estimate`` computes in bulk)."""
        capacity = snapshot.capacity
        running = snapshot.running_requests
        steps = step_times(
            capacity,
            running,
            snapshot.active_kv_blocks,
            self.min_prefill_share,
            self.running_cost,
        )
        pending = snapshot.pending_prefill_tokens
        if pending > 0 or running > 0:  # busy: it takes the request at its next step
            wait = 0.5 * steps.decode_step_s + max(pending, 0) * steps.prefill_s_per_token
            if pending > 0 and snapshot.pending_attention_s > 0:
                wait += snapshot.pending_attention_s
        else:
            wait = 0.0
        saved, load_s = (0.0, 0.0)
        if hit is not None and hit.num_blocks > 0:
            saved, load_s = self.held(hit, capacity, len(request.key.block_hashes))
        uncached, shared_load_s = self.with_shared(
            request, capacity, self.uncached(request, saved), shared_blocks
        )
        load_s += shared_load_s
        attention = capacity.prefill_attention_s(request.prompt_tokens, uncached)
        prefill_s = attention + max(
            uncached * steps.prefill_s_per_token, steps.decode_step_s + uncached * steps.token_s
        )
        queued = max(snapshot.queued_requests, 0)
        waiting = queued if queued else (1 if pending > 0 else 0)
        return ReplicaEstimate(
            steps=steps,
            queue_wait_s=wait,
            uncached_tokens=uncached,
            prefill_s=prefill_s,
            load_s=load_s,
            ttft_s=wait + prefill_s + load_s,
            work_s=uncached * steps.token_s + attention,
            waiting_requests=waiting,
            delay_s=min(uncached, steps.prefill_chunk_tokens) * steps.token_s,
        )

    def estimate(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        hits: Mapping[ReplicaId, PrefixHit],
        work_price: float = 0.0,
        credit: tuple[Sequence[int], int] | None = None,
        shared_blocks: int = 0,
    ) -> CandidateEstimates:
        """``explain`` for every candidate, fast (the routing hot path), each priced with
        ``ReplicaEstimate.cost(work_price, queue_externality)``.

        ``credit``: (positions, blocks): the replicas at these positions are estimated as if
        they held at least the prompt's first ``blocks`` blocks in GPU memory (a hot group's
        members: the policy does not charge a request for the copy its group's traffic has
        paid for). The holders list keeps what the registry said.

        ``shared_blocks``: the cluster's shared tier holds the prompt's first blocks; every
        replica that reads it (``reads_shared_tier``) is estimated loading from there what it does
        not hold itself (``with_shared``).

        What does not depend on the request (a replica's step times, queue wait, backlog) is
        kept per snapshot object (``ReplicaTerms``, ``ttft_terms.py``) and recomputed only for
        the snapshots that are not the very objects of the previous call: adapters hand over the
        same frozen snapshot while a replica's load is unchanged, and between two decisions only
        a few replicas' loads change (the one just routed to, the reports that came in)."""
        if replicas is self._prepared:
            terms, self._prepared = self._terms, None
        else:
            terms = self._terms.update(replicas, self.running_cost)
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        least_uncached = 1 if prompt else 0  # vLLM always computes the last token
        uncached_at, load_at, holders, any_speculative = self._held_by(
            request, replicas, hits, terms.position, prompt, least_uncached
        )
        if credit is not None:
            self._credit(request, credit, prompt, least_uncached, uncached_at, load_at)
        if shared_blocks > 0:
            load_at = self._from_shared(request, replicas, shared_blocks, uncached_at, load_at)
        costs = candidate_costs(terms, uncached_at, load_at, prompt, 1.0 + work_price)
        least_backlog_s = min(terms.backlogs) if replicas else 0.0
        return CandidateEstimates(
            list(terms.waits), costs, least_backlog_s, holders, any_speculative
        )

    def _held_by(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        hits: Mapping[ReplicaId, PrefixHit],
        position: Mapping[ReplicaId, int],
        prompt: int,
        least_uncached: int,
    ) -> tuple[list[int], list[float] | None, list[Holder], bool]:
        """What each candidate computes of the prompt given what it holds: (uncached tokens
        per position, load seconds per position or None when nothing loads, the holders in
        position order, whether any hit is speculative)."""
        count = len(replicas)
        uncached_at = [prompt] * count
        load_at: list[float] | None = None
        holders: list[Holder] = []
        any_speculative = False
        if not hits:
            return uncached_at, load_at, holders, any_speculative
        key_blocks = len(request.key.block_hashes)
        block_size = self.block_size
        cpu_discount = 1.0 - self.cpu_fallback_credit
        # Registry lookups hand every replica with the same row the same PrefixHit (on a
        # hot prefix, dozens of holders share one or two): an all-GPU hit, whose uncached
        # count does not depend on the replica, is worked out once per run of one object.
        same_hit: PrefixHit | None = None
        same_uncached = 0
        for replica_id, hit in hits.items():
            index = position.get(replica_id)
            if index is None:
                continue
            if hit is same_hit:
                holders.append((index, hit, same_uncached))
                uncached_at[index] = same_uncached
                continue
            held_blocks = hit.num_blocks
            if held_blocks <= 0:
                continue
            _, cpu, disk = hit.blocks_by_tier
            load_s = 0.0
            shared = False
            if disk or held_blocks > key_blocks or cpu > held_blocks:
                saved, load_s = self.held(hit, replicas[index].capacity, key_blocks)
                uncached = int(prompt - saved + 0.5)
            elif not cpu:  # all in GPU memory: the common hit
                uncached = prompt - held_blocks * block_size
                shared = True
            elif (cpu_load := replicas[index].capacity.cpu_load_s_per_block) > 0:
                uncached = prompt - held_blocks * block_size
                load_s = cpu * cpu_load
            else:  # CPU blocks, credited (on this replica: another may load them)
                uncached = int(prompt - (held_blocks - cpu * cpu_discount) * block_size + 0.5)
            if uncached < least_uncached:
                uncached = least_uncached
            holders.append((index, hit, uncached))
            if hit.num_speculative > 0:
                any_speculative = True
            uncached_at[index] = uncached
            if shared:
                same_hit, same_uncached = hit, uncached
            if load_s:
                if load_at is None:
                    load_at = [0.0] * count
                load_at[index] = load_s
        if len(holders) > 1:
            holders.sort(key=_position_of)
        return uncached_at, load_at, holders, any_speculative

    def _credit(
        self,
        request: RouteRequest,
        credit: tuple[Sequence[int], int],
        prompt: int,
        least_uncached: int,
        uncached_at: list[int],
        load_at: list[float] | None,
    ) -> None:
        """A hot group's members computed as if they held its first blocks in GPU memory
        (``uncached_at`` and ``load_at`` are the estimate's own lists, lowered in place)."""
        credit_blocks = min(credit[1], len(request.key.block_hashes))
        credit_uncached = max(prompt - credit_blocks * self.block_size, least_uncached)
        for index in credit[0]:
            if uncached_at[index] > credit_uncached:
                uncached_at[index] = credit_uncached
                if load_at is not None:
                    load_at[index] = 0.0

    def _from_shared(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        shared_blocks: int,
        uncached_at: list[int],
        load_at: list[float] | None,
    ) -> list[float] | None:
        """Each replica that reads the shared tier loads from there what it does not hold
        (``uncached_at`` lowered in place); returns the load seconds per position."""
        for index, snapshot in enumerate(replicas):
            left, shared_load_s = self.with_shared(
                request, snapshot.capacity, uncached_at[index], shared_blocks
            )
            if shared_load_s > 0:
                uncached_at[index] = left
                if load_at is None:
                    load_at = [0.0] * len(replicas)
                load_at[index] += shared_load_s
        return load_at


_position_of = itemgetter(0)
