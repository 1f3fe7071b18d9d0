"""The KV connector's scheduler side (one per engine, in vLLM's scheduler process): keeps the
``TierPlanner`` (what the tiers hold, the policy, load and store decisions), matches each
request's blocks against the tiers, and builds each step's ``StepPlan`` for the workers
(``worker_side.py``); the connector (``connector.py``) hands it vLLM's calls."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.config import KVCacheConfig
from prefixmesh.replica.events.kv_events import OWN_EVENTS
from prefixmesh.replica.kvcache.ahead import AheadOfNeed, WaitingPrompt
from prefixmesh.replica.kvcache.connector_stats import USABLE, counts_since
from prefixmesh.replica.kvcache.disk import scan
from prefixmesh.replica.kvcache.folders import measure_read_rate
from prefixmesh.replica.kvcache.plan import LoadCosts, StepPlan
from prefixmesh.replica.kvcache.planner import TierPlanner
from prefixmesh.replica.kvcache.policy import ManualClock, RequestQueue, make_tier_policy
from prefixmesh.replica.kvcache.policy.base import chain_refs
from prefixmesh.replica.kvcache.prefill_rate import PrefillRateMeter
from prefixmesh.replica.kvcache.shared import SharedDirIndex
from prefixmesh.replica.kvcache.waiting_channel import NoticeReceiver, OutsideWaits

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerSetup:
    """What the scheduler side is told of its engine, read once from vLLM's config."""

    settings: KVCacheConfig
    block_size: int
    hasher: BlockHasher
    step_tokens: int
    """The scheduler's token budget per step."""
    ranks: int
    device_type: str
    disk_root: Path
    disk_dir: Path
    """Rank 0's folder of the disk tier (every rank stores the same blocks)."""
    shared_root: Path
    shared_dir: Path
    """Rank 0's folder of the shared tier."""
    layout_tag: str
    waiting_socket: str | None
    prefill_tokens_per_s: float


@dataclass(slots=True)
class _RequestState:
    request: Request
    blocks: list[BlockHash] = field(default_factory=list)
    offered: int = 0
    """Blocks before this index were offered to the CPU tier already."""
    match_start: int = 0
    match_blocks: int = 0
    match_async: bool = False
    scheduled: bool = False
    """The scheduler looked at it (the policy heard of its use then, as it runs)."""


@dataclass(frozen=True, slots=True)
class _SharedTier:
    """The shared tier as this replica can use it (``blocks`` 0: none)."""

    blocks: int
    read_rate: float
    states: dict[str, int]
    """States not yet reported (the shared tier's, when there is one)."""


class SchedulerSide:
    def __init__(self, setup: SchedulerSetup, kv_cache_config: Any) -> None:
        settings = setup.settings
        self._block_size = setup.block_size
        self._hasher = setup.hasher
        page_bytes = _page_bytes(kv_cache_config)
        capacity = {
            Tier.CPU: int(settings.cpu_tier_gib * 2**30) // page_bytes,
            Tier.DISK: int(settings.disk_tier_gib * 2**30) // page_bytes,
        }
        rates = _read_rates(settings, setup.disk_root, bool(capacity[Tier.DISK]))
        shared = _shared_tier(settings, setup.shared_root, page_bytes)
        self._states = dict(shared.states)
        """States not yet reported (the shared tier's, when there is one)."""
        self._reported: dict[str, int] = {}
        prefill_tokens_per_s = setup.prefill_tokens_per_s
        costs = LoadCosts(
            setup.block_size, page_bytes, prefill_tokens_per_s, rates, shared.read_rate
        )
        # The configured rate is a guess made before the engine ran (on another machine, for
        # another model): the steps themselves say what a recompute costs here.
        self._prefill_rate = PrefillRateMeter(prefill_tokens_per_s, min_tokens=2 * setup.block_size)
        self._clock = ManualClock()
        managed = make_tier_policy(
            settings,
            clock=self._clock,
            block_tokens=setup.block_size,
            capacities=(capacity[Tier.CPU], capacity[Tier.DISK]),
        )
        self._queue = managed.queue
        self._outside = _notice_receiver(setup.waiting_socket, self._queue)
        """Requests the replica holds back before the engine (``waiting_channel.py``)."""
        self._outside_waits = OutsideWaits(self._queue) if self._queue is not None else None
        self.planner = TierPlanner(
            managed.policy,
            capacity,
            costs,
            share=shared.blocks > 0,
            step_tokens=setup.step_tokens,
        )
        self.ahead = AheadOfNeed(
            self.planner,
            settings.prefetch_blocks if settings.async_loads else 0,
            setup.ranks,
        )
        self._shared = self._start_shared(setup, shared.blocks)
        if capacity[Tier.DISK]:
            found = scan(setup.disk_dir, setup.layout_tag, page_bytes)
            self.planner.restore(Tier.DISK, [entry.block for entry in found])
        self._async_loads = settings.async_loads
        self._layerwise = layerwise_loads(settings, setup.device_type)
        self._step_tokens = setup.step_tokens
        self._requests: dict[str, _RequestState] = {}
        self._loaded: dict[int, tuple[BlockHash, Tier | None]] = {}
        """Engine block -> what this step's synchronous loads put there, and from which of
        this replica's tiers (None: the shared folder)."""
        self._loading: dict[str, dict[int, tuple[BlockHash, Tier | None]]] = {}
        """The same for each asynchronous load until the worker reports it done."""
        restored = self.planner.size(Tier.DISK)
        _log_ready(settings, capacity, rates, shared, page_bytes, restored, prefill_tokens_per_s)

    @staticmethod
    def _start_shared(setup: SchedulerSetup, blocks: int) -> SharedDirIndex | None:
        """The shared folder's listing, kept fresh by its thread (None: no shared tier)."""
        if not blocks:
            return None
        index = SharedDirIndex(setup.shared_dir, blocks, setup.settings.shared_scan_interval_s)
        index.start()
        return index

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
            self._extend(state, len(request.prompt_token_ids or ()) // self._block_size)
        return state

    def _extend(self, state: _RequestState, num_blocks: int) -> None:
        """Hash the request's blocks up to ``num_blocks`` (prompt, then its output)."""
        have = len(state.blocks)
        if num_blocks <= have:
            return
        size = self._block_size
        tokens = state.request.all_token_ids[have * size : num_blocks * size]
        parent = state.blocks[-1] if state.blocks else None
        state.blocks.extend(self._hasher.chain(parent, tokens))

    def arrived(self, request: Request) -> None:
        """A request joined the engine's waiting queue: its blocks are hashed, and a lookahead
        hears what it is about to load."""
        state = self._state(request)
        usable = (request.num_tokens - 1) // self._block_size  # vLLM computes the last token
        self.ahead.waiting(WaitingPrompt(request.request_id, state.blocks, usable))
        if self._queue is not None:
            self.hear_outside()  # its own wait outside ends before it arrives here
            self._queue.queued(request.request_id, state.blocks)

    def hear_outside(self) -> None:
        """Tell the lookahead of the requests the replica started or stopped holding back."""
        if self._outside is not None and self._outside_waits is not None:
            self._outside_waits.hear(self._outside.drain(), time.monotonic())

    def started(self, request_id: str) -> None:
        """It left the waiting queue (its blocks are allocated, or it finished waiting)."""
        self.ahead.left(request_id)
        if self._queue is not None:
            self._queue.started(request_id)

    def match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load and whether asynchronously (vLLM's ``get_num_new_matched_tokens``)."""
        state = self._state(request)
        if not state.scheduled:  # a use is when it runs, not while it waits
            state.scheduled = True
            self._clock.set(time.monotonic())
            self.planner.on_request(chain_refs(state.blocks))
        size = self._block_size
        start = num_computed_tokens // size
        limit = (request.num_tokens - 1) // size
        state.match_start = start
        if self._shared is not None:
            self.planner.shared_view(self._shared.blocks)
        count = state.match_blocks = self.planner.match(state.blocks, start, limit)
        state.match_async = self._async_loads and count > 0
        # Its first step computes up to a step's budget of its own tokens past the load.
        compute = min(request.num_tokens - (start + count) * size, self._step_tokens)
        if state.match_async and self._layerwise:
            loaded = state.blocks[start : start + count]
            state.match_async = not self.planner.hides_under_compute(loaded, compute)
        elif not state.match_async:
            self.planner.joins_step(compute)
        return count * size, state.match_async

    def plan_loads(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        state = self._requests[request.request_id]
        start, count = state.match_start, num_tokens // self._block_size
        blocks = state.blocks[start : start + count]
        engine_blocks = block_ids[start : start + count]
        request_id = request.request_id if state.match_async else None
        jobs = self.planner.plan_loads(blocks, engine_blocks, request_id, layerwise=self._layerwise)
        loaded = self._loaded if request_id is None else self._loading.setdefault(request_id, {})
        for job in jobs:
            loaded[job.engine_block] = (job.block, None if job.shared else job.tier)

    def step(self, output: SchedulerOutput, manager: KVCacheManager | None) -> StepPlan:
        """This step's plan: the blocks the scheduled requests computed are offered to the
        tiers (``manager``: vLLM's, where their engine blocks are)."""
        self.hear_outside()
        size = self._block_size
        meter = self._prefill_rate
        samples = meter.samples
        rate = meter.scheduled(
            time.monotonic(),
            output.num_scheduled_tokens.keys(),
            output.total_num_scheduled_tokens,
            loads=bool(self._loaded),
        )
        self.planner.measured_prefill(rate)
        if samples == 0 and meter.samples:
            logger.info("prefixmesh KV connector: prefill measured at %.0f tokens/s", rate)
        scheduled = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        scheduled += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for req_id, computed in scheduled:
            state = self._requests.get(req_id)
            if state is None or manager is None:
                continue
            end = (computed + output.num_scheduled_tokens.get(req_id, 0)) // size
            end = min(end, len(state.request.all_token_ids) // size)
            if end <= state.offered:
                continue
            self._extend(state, end)
            block_ids = manager.get_block_ids(req_id)[0]
            refs = chain_refs(state.blocks[: min(end, len(block_ids))])
            for ref in refs[state.offered :]:
                self.planner.offer(ref, block_ids[ref.position])
            self.planner.touch(refs)
            state.offered = end
        for req_id in output.finished_req_ids:
            self._requests.pop(req_id, None)
        if self._shared is not None:
            self.planner.shared_view(self._shared.blocks)
        self.ahead.plan()
        # The next step carries the running batch: a decode step (measured) and the prefills
        # it continues, the compute its layer-by-layer loads hide under.
        prefilling = 0
        for req_id, computed in scheduled:
            state = self._requests.get(req_id)
            if state is not None:
                done = computed + output.num_scheduled_tokens.get(req_id, 0)
                prefilling += max(0, state.request.num_prompt_tokens - done)
        return self.planner.take_plan(
            carried_s=meter.decode_step_s if output.num_scheduled_tokens else 0.0,
            carried_tokens=prefilling,
        )

    def forget_failed(self, engine_blocks: set[int]) -> None:
        maps = [self._loaded, *self._loading.values()]
        for engine_block in engine_blocks:
            for loaded in maps:
                found = loaded.get(engine_block)
                if found is not None:
                    if found[1] is not None:  # a shared block's next listing says it went
                        self.planner.forget_failed([found[0]], found[1])
                    break

    def load_finished(self, request_id: str) -> None:
        self._loading.pop(request_id, None)
        self.planner.load_finished(request_id)

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.started(request_id)  # aborted while it waited

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        if self._outside is not None:
            self._outside.close()

    def stats(self) -> dict[str, int]:
        """The counts since the last call, and any state not yet reported."""
        counters = self.planner.counters
        now = {
            "cpu_loads": counters.loads[Tier.CPU],
            "disk_loads": counters.loads[Tier.DISK],
            "shared_loads": counters.shared_loads,
            "cpu_stores": counters.stores[Tier.CPU],
            "disk_stores": counters.stores[Tier.DISK],
            "shares": counters.shares,
            "moves": counters.moves,
            "drops": sum(counters.drops.values()),
            "rejected": counters.rejected,
            "loads_declined": counters.loads_declined,
            "async_loads": counters.async_loads,
            "layer_loads": counters.layer_loads,
            "shared_scan_errors": self._shared.scan_errors if self._shared is not None else 0,
            "outside_waits": self._outside_waits.waits if self._outside_waits else 0,
            "prefetched": counters.prefetched,
            "prefetch_failed": counters.prefetch_failed,
        }
        moved = counts_since(now, self._reported)
        self._reported = now
        states, self._states = self._states, {}
        return {**moved, **states}

    def events(self) -> list[Any]:
        self._loaded.clear()  # a load's failure is reported in the step that ran it
        out: list[Any] = []
        for change in self.planner.take_changes():
            medium = change.tier.name
            hashes: list[bytes | int] = list(change.blocks)  # vLLM's event field type
            if change.kind is EventKind.STORED:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self._block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        ownership=OWN_EVENTS,
                    )
                )
            else:
                out.append(BlockRemoved(block_hashes=hashes, medium=medium, ownership=OWN_EVENTS))
        return out


def layerwise_loads(settings: KVCacheConfig, device_type: str) -> bool:
    """Whether this engine loads CPU-tier blocks layer by layer (a copier thread: CPU only)."""
    return settings.layerwise_loads and device_type == "cpu"


def _page_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block over every layer of this rank (what one tier slot holds)."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        total += group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    if total <= 0:
        raise ValueError("the KV cache config has no attention layers")
    return total


def _measure_memcpy(nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of one large host copy (the CPU tier's read path), best of three."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _read_rates(settings: KVCacheConfig, disk_root: Path, has_disk: bool) -> dict[Tier, float]:
    """Bytes/s each local tier reads at: the configured rate, else measured here."""
    return {
        Tier.CPU: (settings.cpu_read_gb_per_s or 0) * 1e9 or _measure_memcpy(),
        Tier.DISK: (settings.disk_read_gb_per_s or 0) * 1e9
        or (measure_read_rate(disk_root) if has_disk else 1.0),
    }


def _shared_tier(settings: KVCacheConfig, shared_root: Path, page_bytes: int) -> _SharedTier:
    """The shared tier's size in blocks and read rate; none when its folder cannot be used."""
    blocks = int(settings.shared_tier_gib * 2**30) // page_bytes
    rate = (settings.shared_read_gb_per_s or 0) * 1e9 or 1.0
    states: dict[str, int] = {USABLE: 1} if blocks else {}
    if blocks and not settings.shared_read_gb_per_s:
        try:
            rate = measure_read_rate(shared_root)
        except OSError as exc:  # unwritable, full: serve without it
            logger.warning("no shared KV tier: %s cannot be used (%s)", shared_root, exc)
            blocks = 0
            states = {USABLE: 0}
    return _SharedTier(blocks, rate, states)


def _notice_receiver(socket_path: str | None, queue: RequestQueue | None) -> NoticeReceiver | None:
    """Where the replica's notices of held requests arrive (None: no socket, or no lookahead)."""
    if not socket_path or queue is None:
        return None
    try:
        return NoticeReceiver(socket_path)
    except OSError as exc:  # the lookahead still hears vLLM's own queue
        logger.warning("lookahead: held requests unheard at %s (%s)", socket_path, exc)
        return None


def _log_ready(
    settings: KVCacheConfig,
    capacity: dict[Tier, int],
    rates: dict[Tier, float],
    shared: _SharedTier,
    page_bytes: int,
    restored: int,
    prefill_tokens_per_s: float,
) -> None:
    """One line of what the scheduler side starts with."""
    logger.info(
        "prefixmesh KV connector: %d CPU blocks, %d disk blocks, %d shared blocks of %d "
        "bytes (%d restored); read %.2f / %.2f / %.2f GB/s, prefill %.0f tokens/s, policy %s"
        " (lookahead over %d waiting requests)",
        capacity[Tier.CPU],
        capacity[Tier.DISK],
        shared.blocks,
        page_bytes,
        restored,
        rates[Tier.CPU] / 1e9,
        rates[Tier.DISK] / 1e9,
        shared.read_rate / 1e9,
        prefill_tokens_per_s,
        settings.policy,
        settings.lookahead_requests,
    )
