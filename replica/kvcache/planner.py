"""The KV connector's scheduler-side brain (pure: no torch, no vLLM, no I/O): which blocks the
lower tiers hold, which of a new request's blocks to load from them, and which computed blocks
to write down, all decided by one ``CachePolicy``.

The lower tiers are inclusive of the engine's own cache: a block is written to the CPU tier
while the engine still holds it (write-through, gated by admission), because vLLM frees an
engine block without asking anyone, so there is no later moment to save it. CPU and disk are
exclusive of each other: a CPU victim moves down to disk when the policy admits it there, else
it is dropped; a disk block that the policy admits to the CPU tier again is written there from
the engine copy its load just made, and leaves the disk (promotion). The engine tier itself is
vLLM's; the policy sees only tiers 1 (CPU) and 2 (disk).

Each engine step the planner hands the worker one ``StepPlan``: the loads to run before the
forward pass, and an ordered list of moves, drops and stores to run after it (stores read
blocks the pass has just computed). Residency changes become tier-tagged events. The plan's
values (jobs, ``StepPlan``, ``TierChange``, ``LoadCosts``) are in ``plan.py``.

A load can also be asynchronous (Strata's rule: loading never leaves the batch waiting): the
request waits outside the batch while a loader runs its ``RequestLoad`` beside the engine's
steps, and joins once the worker reports it done (``load_finished``). Its blocks stay pinned
until then, and the loads still queued count against the next request's: a load that would
wait behind them longer than recomputing takes is not made (``match``). A load from this
replica's memory may instead run inside its step, layer by layer, where the step's compute
hides the copy: Strata's balanced batch, per step (``hides_under_compute``). The step being
scheduled sums its layer copies and its compute (the running batch it carries, plus each request
that joins it); a load that would leave the step loading-bound goes beside the batch.

With a shared tier (a folder every replica shares, ``shared.py``) the planner also loads blocks
that other replicas wrote there (``shared_view``: the folder's latest listing) when this
replica's own tiers do not hold them, and writes each block it computes there once. The shared
tier is the cluster's, not this replica's policy's: nothing here evicts from it or pins it.

While compute is the bottleneck (the step's token budget spent on prefills, so vLLM looks at
no waiting request), the loader would idle. The planner then promotes a waiting request's disk
and shared-folder blocks into the CPU tier ahead of it (``prefetch``: Strata's rule that
neither the transfer queue nor the compute idle while the other is the bottleneck), so that
when its turn comes its load is a memory copy (in its step, or a short one beside the batch)
instead of a read. A prefetched block's CPU slot is reserved when it is planned, and it becomes
the CPU tier's (leaving this replica's disk: the tiers stay exclusive) once the worker reports
the read done (``prefetched``); until then every decision sees it where it was. The request's
blocks in the CPU tier stay pinned until it leaves the queue (``release``): a prefill streaming
through a small tier would otherwise push them down again before their turn.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.kvcache.plan import (
    DropJob,
    Job,
    LoadCosts,
    LoadJob,
    MoveJob,
    Prefetch,
    RequestLoad,
    ShareJob,
    StepPlan,
    StoreJob,
    TierChange,
)
from prefixmesh.replica.kvcache.policy.base import BlockRef, CachePolicy

LOWER_TIERS: tuple[Tier, ...] = (Tier.CPU, Tier.DISK)
MAX_SHARING = 65_536
"""Shared-folder writes remembered until the listing shows them (then forgotten wholesale)."""


@dataclass(slots=True)
class _StepLoad:
    """The engine step being scheduled: its layer-by-layer copies and the compute that hides
    them, in seconds, and the tokens it computes (at most the step's budget)."""

    copy_s: float = 0.0
    compute_s: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class _Counters:
    loads: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in LOWER_TIERS})
    stores: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in LOWER_TIERS})
    moves: int = 0
    drops: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in LOWER_TIERS})
    rejected: int = 0
    promotions: int = 0
    loads_declined: int = 0
    """Blocks held in a lower tier but recomputed: loading them would not have been faster
    (their read, or the wait behind the loads queued before them)."""
    async_loads: int = 0
    """Requests whose blocks were loaded beside the engine's steps."""
    layer_loads: int = 0
    """Requests whose CPU-tier blocks were loaded inside their step, layer by layer."""
    shared_loads: int = 0
    """Blocks loaded from the shared folder (another replica computed them)."""
    shares: int = 0
    """Blocks this replica wrote to the shared folder (or found there first by another)."""
    prefetched: int = 0
    """Blocks promoted from disk into the CPU tier ahead of a waiting request."""
    prefetch_failed: int = 0
    """Blocks whose promotion ahead failed (unreadable, or a load still reading the file)."""


class TierPlanner:
    def __init__(
        self,
        policy: CachePolicy,
        capacity_blocks: dict[Tier, int],
        costs: LoadCosts,
        *,
        share: bool = False,
        step_tokens: int | None = None,
    ) -> None:
        """``step_tokens``: the most tokens one engine step computes (vLLM's
        ``max_num_batched_tokens``; None: no limit)."""
        self.policy = policy
        self.capacity = {t: max(0, int(capacity_blocks.get(t, 0))) for t in LOWER_TIERS}
        self.costs = costs
        self._tier: dict[BlockHash, Tier] = {}
        self._ref: dict[BlockHash, BlockRef] = {}
        self._size = {t: 0 for t in LOWER_TIERS}
        self._pinned: set[BlockHash] = set()
        self._loading: dict[str, RequestLoad] = {}
        """Asynchronous loads the worker has not reported done: their blocks stay pinned."""
        self._loading_pins: dict[BlockHash, int] = {}
        self._backlog_s = 0.0
        self._async: list[RequestLoad] = []
        self._loads: list[LoadJob] = []
        self._jobs: list[Job] = []
        self._changes: list[TierChange] = []
        self._share = share
        self._shared: Collection[BlockHash] = frozenset()
        self._sharing: set[BlockHash] = set()
        """Blocks this replica queued for the shared folder that its listing has not shown."""
        self._step_tokens = step_tokens
        self._step = _StepLoad()
        self._arriving: dict[BlockHash, BlockRef] = {}
        """Blocks being promoted into the CPU tier ahead of need: a CPU slot each, reserved."""
        self._batches: dict[int, tuple[BlockRef, ...]] = {}
        self._next_batch = 0
        self._prefetches: list[Prefetch] = []
        self._kept: dict[str, tuple[BlockHash, ...]] = {}
        """Waiting request -> its CPU-tier blocks a promotion ahead keeps for it (pinned)."""
        self._kept_pins: dict[BlockHash, int] = {}
        self.counters = _Counters()

    # ---- state ---------------------------------------------------------------------------------

    def tier_of(self, block: BlockHash) -> Tier | None:
        return self._tier.get(block)

    def size(self, tier: Tier) -> int:
        return self._size[tier]

    def blocks_in(self, tier: Tier) -> list[BlockHash]:
        return [b for b, t in self._tier.items() if t == tier]

    def measured_prefill(self, tokens_per_s: float) -> None:
        """The engine's prefill rate as measured now (``PrefillRateMeter``): what a load is
        weighed against from here on."""
        self.costs = replace(self.costs, prefill_tokens_per_s=tokens_per_s)

    def shared_view(self, blocks: Collection[BlockHash]) -> None:
        """The shared folder's latest listing (a snapshot the caller never changes: the same
        object again costs nothing, so it may be handed over at every match)."""
        if blocks is self._shared:
            return
        self._shared = blocks
        if self._sharing:  # what this replica queued and the folder now shows is done
            self._sharing = {block for block in self._sharing if block not in blocks}
            if len(self._sharing) > MAX_SHARING:  # writes that never landed (a full disk)
                self._sharing.clear()

    def restore(self, tier: Tier, blocks: Iterable[BlockHash]) -> None:
        """Blocks a tier already holds at start (the disk index, oldest first); past the
        capacity the oldest are dropped. Parents are unknown after a restart."""
        for block in blocks:
            if block in self._tier:
                continue
            ref = BlockRef(block, None, 0)
            if self._size[tier] >= self.capacity[tier] and not self._evict_for(tier, ref):
                self._jobs.append(DropJob(block, tier))
                continue
            self._insert(tier, ref)

    # ---- a new request -------------------------------------------------------------------------

    def on_request(self, refs: Sequence[BlockRef], category: str = "") -> None:
        """A request arrived with these full prompt blocks: hotness, then recency."""
        self.policy.on_request(refs, category)
        self.touch(refs)

    def touch(self, refs: Sequence[BlockRef]) -> None:
        """``refs`` (one request's blocks) were just used: the held ones become the most
        recent, the deepest first to go (a block is worthless without its parent)."""
        for tier in LOWER_TIERS:
            held = [ref for ref in refs if self._tier.get(ref.block) == tier]
            if held:
                self.policy.touch(tier, held)

    @property
    def backlog_s(self) -> float:
        """Seconds of asynchronous loads handed to the worker and not reported done."""
        return self._backlog_s

    def match(self, blocks: Sequence[BlockHash], start: int, limit: int) -> int:
        """How many blocks from index ``start`` (the engine's own hit) to load: the longest
        run the lower tiers hold, cut where loading the rest no longer beats recomputing it
        (at most ``limit`` blocks in all: vLLM computes at least the prompt's last token).
        A load waits behind the asynchronous loads still queued: nothing is loaded unless it
        beats recomputing by more than that wait."""
        best = run = 0
        saved = 0.0
        best_saved = self._backlog_s
        for block in blocks[start:limit]:
            source = self._source(block)
            if source is None:
                break
            run += 1
            saved += self.costs.saving_s(*source)
            if saved > best_saved:
                best, best_saved = run, saved
        if run > best:
            self.counters.loads_declined += run - best
        return best

    def hides_under_compute(self, blocks: Sequence[BlockHash], compute_tokens: int) -> bool:
        """Strata's balanced batch, per step: load ``blocks`` inside the step being scheduled,
        layer by layer, when every one is in this replica's CPU tier (a memory copy: no disk
        read on the step path) and the step's copies, these included, take no longer than its
        compute: the running batch it carries (``take_plan``) and every request joining it,
        this one's ``compute_tokens`` included. Copies overlap the whole step's compute, layer
        by layer, not only their own request's. A load that would leave the step loading-bound
        goes beside the batch instead, where it stalls no one. A yes counts the request into
        the step (as ``joins_step``)."""
        if not blocks or compute_tokens <= 0:
            return False
        if any(self._source(block) != (Tier.CPU, False) for block in blocks):
            return False
        step = self._step
        copy_s = len(blocks) * self.costs.load_s(Tier.CPU)
        tokens = self._within_budget(compute_tokens)
        if step.copy_s + copy_s > step.compute_s + tokens / self.costs.prefill_tokens_per_s:
            return False
        step.copy_s += copy_s
        self._count_compute(tokens)
        return True

    def joins_step(self, compute_tokens: int) -> None:
        """A request computes ``compute_tokens`` in the step being scheduled (with no copy of
        its own in it): more compute to hide other requests' copies under."""
        self._count_compute(self._within_budget(compute_tokens))

    def _count_compute(self, tokens: int) -> None:
        self._step.tokens += tokens
        self._step.compute_s += tokens / self.costs.prefill_tokens_per_s

    def _within_budget(self, tokens: int) -> int:
        if self._step_tokens is None:
            return tokens
        return max(0, min(tokens, self._step_tokens - self._step.tokens))

    def _source(self, block: BlockHash) -> tuple[Tier, bool] | None:
        """Where a load of ``block`` reads from: this replica's tier, else the shared folder."""
        tier = self._tier.get(block)
        if tier is not None:
            return tier, False
        return (Tier.DISK, True) if block in self._shared else None

    def plan_loads(
        self,
        blocks: Sequence[BlockHash],
        engine_blocks: Sequence[int],
        request_id: str | None = None,
        *,
        layerwise: bool = False,
    ) -> tuple[LoadJob, ...]:
        """Load ``blocks`` into ``engine_blocks`` (after ``match`` said so): in this step
        (``layerwise``: its CPU-tier blocks one layer at a time, counted), or, given the
        request's id, beside the coming steps until ``load_finished``. Returns the jobs."""
        jobs = []
        for block, engine_block in zip(blocks, engine_blocks, strict=True):
            source = self._source(block)
            if source is None:  # evicted since match: vLLM recomputes it (reported as failed)
                raise KeyError(f"block {block:016x} left the lower tiers before its load")
            tier, shared = source
            jobs.append(LoadJob(block, tier, engine_block, shared))
            if shared:
                self.counters.shared_loads += 1
            else:
                self.counters.loads[tier] += 1
        if request_id is None:
            if layerwise and any(job.from_memory for job in jobs):
                self.counters.layer_loads += 1
            self._loads += jobs
            self._pinned.update(blocks)
            return tuple(jobs)
        if request_id in self._loading:
            raise ValueError(f"request {request_id} is loading already")
        seconds = sum(self.costs.load_s(job.tier, job.shared) for job in jobs)
        load = RequestLoad(request_id, tuple(jobs), seconds)
        self._loading[request_id] = load
        self._async.append(load)
        self._backlog_s += load.seconds
        _pin(self._loading_pins, blocks)
        self.counters.async_loads += 1
        return load.jobs

    def load_finished(self, request_id: str) -> None:
        """The worker ran ``request_id``'s asynchronous load (its failed blocks come through
        ``forget_failed``): its blocks may be evicted again."""
        load = self._loading.pop(request_id, None)
        if load is None:
            return
        self._backlog_s = max(0.0, self._backlog_s - load.seconds) if self._loading else 0.0
        _unpin(self._loading_pins, (job.block for job in load.jobs))

    # ---- promotion ahead of need ---------------------------------------------------------------

    @property
    def prefetching(self) -> int:
        """Blocks whose promotion is on its way."""
        return len(self._arriving)

    def prefetch(self, request_id: str, refs: Sequence[BlockRef], limit: int) -> int:
        """Promote the disk and shared-folder blocks of ``refs`` (waiting ``request_id``'s
        prompt, in order) into the CPU tier, at most ``limit`` of them: those up to where the
        lower tiers stop holding the chain, for as long as the policy admits them to the CPU
        tier. Returns how many were planned (0: nothing to promote, or the tier has no room).
        Those and the chain's blocks the CPU tier holds stay pinned until ``release``."""
        chosen: list[BlockRef] = []
        sources: list[bool] = []
        held: list[BlockHash] = []
        for ref in refs:
            if len(chosen) >= limit:
                break
            source = self._source(ref.block)
            if source is None:
                break
            if ref.block in self._arriving or source == (Tier.CPU, False):
                held.append(ref.block)
                continue
            self._pinned.add(ref.block)  # never the victim that makes its own room
            if not self._admit(Tier.CPU, ref):
                break
            self._arriving[ref.block] = ref  # reserves its slot: ``_admit`` counts it
            chosen.append(ref)
            sources.append(source[1])
        if chosen:
            batch = self._next_batch
            self._next_batch += 1
            self._batches[batch] = tuple(chosen)
            blocks = tuple(ref.block for ref in chosen)
            self._prefetches.append(Prefetch(batch, blocks, tuple(sources)))
            kept = tuple(dict.fromkeys((*self._kept.get(request_id, ()), *held, *blocks)))
            self.release(request_id)
            self._kept[request_id] = kept
            _pin(self._kept_pins, kept)
        return len(chosen)

    def release(self, request_id: str) -> None:
        """``request_id`` left the waiting queue (its loads pin what they read from here on):
        the blocks kept for it may be evicted again."""
        _unpin(self._kept_pins, self._kept.pop(request_id, ()))

    def prefetched(self, batch: int, failed: Collection[BlockHash]) -> None:
        """The worker ran promotion ``batch``; ``failed``: the blocks it did not promote (an
        unreadable file, or no free slot). The others are the CPU tier's now. A failed block
        stays where it was: a torn file is deleted when read, and a load of it then fails and
        is recomputed, as any load of a torn file; a sound one is not lost for want of a slot.
        A block an asynchronous load still reads from this replica's disk is not promoted (its
        file must stay until that read)."""
        for ref in self._batches.pop(batch, ()):
            block = ref.block
            del self._arriving[block]
            tier = self._tier.get(block)
            if block in failed or block in self._loading_pins:
                self._jobs.append(DropJob(block, Tier.CPU))  # frees whatever slot it took
                self.counters.prefetch_failed += 1
                continue
            if tier is Tier.DISK:
                self._remove(Tier.DISK, block, dropped=False)
                self._jobs.append(DropJob(block, Tier.DISK))
            self._insert(Tier.CPU, self._ref.get(block, ref))
            self.counters.prefetched += 1

    # ---- computed blocks -----------------------------------------------------------------------

    def offer(self, ref: BlockRef, engine_block: int) -> None:
        """The engine holds ``ref`` in ``engine_block`` at the end of this step: write it to
        the CPU tier if it is not there and the policy admits it; straight to disk when the
        CPU tier has no room this step (a prompt longer than the tier). With a shared tier,
        also to the shared folder unless it holds the block already."""
        if self._share and ref.block not in self._shared and ref.block not in self._sharing:
            self._sharing.add(ref.block)
            self._jobs.append(ShareJob(ref.block, engine_block))
            self.counters.shares += 1
        tier = self._tier.get(ref.block)
        if tier is Tier.CPU or ref.block in self._arriving:  # (the promotion ahead brings it)
            return
        self._pinned.add(ref.block)  # never its own victim on the way down
        if self._admit(Tier.CPU, ref):
            if tier is Tier.DISK:  # promoted: the engine copy goes up, the disk copy goes
                self._remove(Tier.DISK, ref.block, dropped=False)
                self._jobs.append(DropJob(ref.block, Tier.DISK))
                self.counters.promotions += 1
            self._store(Tier.CPU, ref, engine_block)
        elif tier is None and self._admit(Tier.DISK, ref):
            self._store(Tier.DISK, ref, engine_block)
        elif tier is None:
            self.counters.rejected += 1

    def _store(self, tier: Tier, ref: BlockRef, engine_block: int) -> None:
        self._insert(tier, ref)
        self._jobs.append(StoreJob(ref.block, engine_block, tier))
        self.counters.stores[tier] += 1

    # ---- the step ------------------------------------------------------------------------------

    def take_plan(self, *, carried_s: float = 0.0, carried_tokens: int = 0) -> StepPlan:
        """This step's plan. The next step starts carrying ``carried_s`` seconds of compute (the
        running batch's decode step, measured) and ``carried_tokens`` (prefills it continues)."""
        plan = StepPlan(
            tuple(self._loads), tuple(self._jobs), tuple(self._async), tuple(self._prefetches)
        )
        self._prefetches.clear()
        self._step = _StepLoad()
        self.joins_step(carried_tokens)
        self._step.compute_s += carried_s
        self._loads.clear()
        self._jobs.clear()
        self._async.clear()
        self._pinned.clear()
        return plan

    def take_changes(self) -> list[TierChange]:
        changes, self._changes = self._changes, []
        return changes

    def forget_failed(self, blocks: Iterable[BlockHash], tier: Tier) -> None:
        """The worker found these unreadable (a corrupt or vanished file): they are gone (and
        the worker is told to drop whatever it still has of them)."""
        for block in blocks:
            if self._tier.get(block) == tier:
                self._remove(tier, block, dropped=True)
                self._jobs.append(DropJob(block, tier))

    # ---- internals -----------------------------------------------------------------------------

    def _admit(self, tier: Tier, ref: BlockRef) -> bool:
        """Room is made in ``tier`` for ``ref`` if the policy admits it there."""
        if self.capacity[tier] == 0:
            return False
        reserved = len(self._arriving) if tier is Tier.CPU else 0
        if self._size[tier] + reserved < self.capacity[tier]:
            return bool(self.policy.admit(tier, ref.block, None))
        return self._evict_for(tier, ref)

    def _evict_for(self, tier: Tier, ref: BlockRef) -> bool:
        pinned = self._pinned
        if self._loading_pins or self._arriving or self._kept_pins:  # (arriving: still on disk)
            pinned = (
                pinned | self._loading_pins.keys() | self._arriving.keys() | self._kept_pins.keys()
            )
        displaced = self.policy.victim(tier, pinned)
        if displaced is None or not self.policy.admit(tier, ref.block, displaced):
            return False
        self._demote(tier, displaced)
        return True

    def _demote(self, tier: Tier, block: BlockHash) -> None:
        """``block`` leaves ``tier``: down to disk if the policy takes it there, else gone."""
        if tier is Tier.CPU and self._admit(Tier.DISK, self._ref[block]):
            self._remove(tier, block, dropped=False)
            self._insert(Tier.DISK, self._ref[block])
            self._jobs.append(MoveJob(block))
            self.counters.moves += 1
            return
        self._remove(tier, block, dropped=True)
        self._jobs.append(DropJob(block, tier))
        self.counters.drops[tier] += 1

    def _insert(self, tier: Tier, ref: BlockRef) -> None:
        self._tier[ref.block] = tier
        self._ref[ref.block] = ref
        self._size[tier] += 1
        self.policy.on_insert(tier, ref)
        self._changes.append(TierChange(EventKind.STORED, tier, (ref.block,)))

    def _remove(self, tier: Tier, block: BlockHash, *, dropped: bool) -> None:
        del self._tier[block]
        self._size[tier] -= 1
        self.policy.on_remove(tier, block, dropped)
        if dropped:
            del self._ref[block]
        self._changes.append(TierChange(EventKind.REMOVED, tier, (block,)))


def _pin(pins: dict[BlockHash, int], blocks: Iterable[BlockHash]) -> None:
    """One more holder of each of ``blocks`` (counted: a block may have several)."""
    for block in blocks:
        pins[block] = pins.get(block, 0) + 1


def _unpin(pins: dict[BlockHash, int], blocks: Iterable[BlockHash]) -> None:
    for block in blocks:
        left = pins[block] - 1
        if left:
            pins[block] = left
        else:
            del pins[block]
