"""The replica: a Ray Serve deployment around one ``Engine`` (one data-parallel rank).

It streams tokens, holds delay-hit requests while their prefix is being computed here
(``admission/holds.py``), publishes its cache events (to Redis, or to the ingress that keeps the
in-process registry), and reports its load for routing (a ``ReplicaReport``, which Serve polls
through ``record_routing_stats``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from prefixmesh import tracing
from prefixmesh.cache_registry.factory import make_hasher, make_registry
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.registry_health import HEALTHY, RegistryHealth
from prefixmesh.cache_registry.types import (
    SHARED_TIER,
    BlockHash,
    CacheEvent,
    PublishResult,
    ReplicaId,
)
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.metrics.ray_sink import serve_replica_sink
from prefixmesh.metrics.runtime import RuntimeMetrics
from prefixmesh.metrics.sink import PrometheusSink, Tee
from prefixmesh.replica.admission.coalesce import coalesced
from prefixmesh.replica.admission.fair_gate import FairGate
from prefixmesh.replica.admission.fair_share import FairTicket
from prefixmesh.replica.admission.holds import HoldSettings, ReplicaHolds
from prefixmesh.replica.engines.base import (
    BlockChange,
    CacheChangeSink,
    Engine,
    EngineChunk,
    EngineRequest,
    HeldMirror,
    Residency,
)
from prefixmesh.replica.engines.choices import choice_chunks
from prefixmesh.replica.events.progress import ProgressReporter
from prefixmesh.replica.events.publisher import EventPublisher, EventTarget
from prefixmesh.replica.events.shared_tier import SharedTierPublisher
from prefixmesh.replica.kvcache.folders import cache_folder, rank_folder
from prefixmesh.replica.serving.runtime_watch import RuntimeWatch
from prefixmesh.replica.serving.spans import NoTrace, replica_trace
from prefixmesh.wire import (
    GenerateChunk,
    GenerateRequest,
    ReplicaCapacity,
    ReplicaCounters,
    ReplicaReport,
)
from prefixmesh.wire.request_progress import RequestProgress

if TYPE_CHECKING:
    from ray.serve.schema import ReplicaRank

logger = logging.getLogger(__name__)
FINISHED_IDS_KEPT = 1024
"""Finished request ids a replica keeps reporting (``seen_requests``): more than finish in one
routing-stats period at any rate this replica serves."""


class IngressEventTarget:
    """In-process registry mode: the registry lives in the (single) ingress replica."""

    def __init__(self, app_name: str, ingress_name: str) -> None:
        self._app_name = app_name
        self._ingress_name = ingress_name
        self._handle: Any = None

    def _router(self) -> Any:
        from ray import serve

        if self._handle is None:
            self._handle = serve.get_deployment_handle(self._ingress_name, self._app_name)
        return self._handle

    async def request_progress(self, progress: RequestProgress) -> None:
        await self._router().request_progress.remote(progress)

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        try:
            results: list[PublishResult] = await self._router().ingest_cache_events.remote(
                list(events)
            )
        except Exception as exc:  # the ingress restarting: resync once it is back
            logger.warning("ingress unreachable for cache events: %s", exc)
            return [PublishResult(ReplicaId(events[0].replica_id), 0, failed=True)]
        return results


def shared_tier_folder(config: PrefixmeshConfig) -> Path | None:
    """The cluster's shared KV tier folder that rank 0 writes (None: no shared tier)."""
    kvcache = config.kvcache
    if kvcache.shared_tier_gib <= 0:
        return None
    return rank_folder(cache_folder(kvcache.shared_dir, make_hasher(config)), 0)


def make_engine(
    config: PrefixmeshConfig, model_path: str, rank: int, sink: CacheChangeSink
) -> Engine:
    hasher = make_hasher(config)
    if config.replica.engine == "vllm":
        from prefixmesh.replica.engines.vllm_engine import VllmEngine, VllmEngineSettings
        from prefixmesh.replica.kvcache.connector import connector_extra_config

        vllm = config.replica.vllm
        cores = os.cpu_count() or 1
        settings = VllmEngineSettings(
            model_path=model_path,
            block_size=config.cache.block_size,
            max_model_len=vllm.max_model_len,
            kv_cache_bytes=int(vllm.kv_cache_gib * 2**30),
            enforce_eager=vllm.enforce_eager,
            tensor_parallel_size=vllm.tensor_parallel_size,
            cpu_core=rank % cores if vllm.bind_cpu_cores and _no_gpu() else None,
            engine_niceness=vllm.engine_niceness if _no_gpu() else 0,
            max_num_batched_tokens=vllm.max_num_batched_tokens,
            prefill_tokens_per_s=vllm.prefill_tokens_per_s,
            decode_step_s=vllm.decode_step_s,
            calibrate=vllm.calibrate,
            kv_connector_extra=(
                connector_extra_config(config, vllm.prefill_tokens_per_s)
                if config.kvcache.tiers_enabled
                else None
            ),
            shared_folder=str(shared) if (shared := shared_tier_folder(config)) else None,
            shared_read_bytes_per_s=(config.kvcache.shared_read_gb_per_s or 0) * 1e9 or None,
            priority_scheduling=config.replica.fair_share.enabled,
        )
        return VllmEngine(settings, hasher, sink)
    if config.replica.engine == "remote":
        from prefixmesh.replica.engines.remote_engine import RemoteEngine, RemoteEngineSettings

        remote = config.replica.remote
        url = remote.urls[rank % len(remote.urls)]
        return RemoteEngine(
            RemoteEngineSettings(
                url,
                remote.connect_timeout_s,
                remote.request_timeout_s,
                remote.reconnect_interval_s,
                remote.unhealthy_after_s,
            ),
            hasher,
            sink,
        )
    from prefixmesh.replica.engines.sim_engine import SimEngine
    from prefixmesh.replica.sim_model.profile import get_profile

    sim = config.replica.sim
    profile = get_profile(sim.profile)
    if sim.kv_blocks is not None:
        profile = dataclasses.replace(profile, kv_blocks=sim.kv_blocks)
    return SimEngine(profile, hasher, sink, time_scale=sim.time_scale)


def _no_gpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


class _Announcement:
    """Whether the engine was told that a request waits here, before it (its cache policy may
    keep what the request will need); told once, withdrawn once."""

    __slots__ = ("_blocks", "_engine", "_rid", "announced")

    def __init__(self, engine: Engine, rid: str, blocks: Sequence[BlockHash]) -> None:
        self._engine = engine
        self._rid = rid
        self._blocks = blocks
        self.announced = False

    def waits_here(self) -> None:
        """Held back before the engine: tell it (once)."""
        if not self.announced:
            self.announced = True
            self._engine.announce(self._rid, self._blocks)

    def withdraw(self) -> None:
        """It waits here no longer (it reached the engine, or it ended)."""
        if self.announced:
            self.announced = False
            self._engine.withdraw(self._rid)


class ReplicaCore:
    """The replica's logic over its parts, built by its constructor (tests pass fakes): it
    serves requests (holds, fair share, the engine's stream), counts what reached it, reports
    its load and leaves for good. ``ReplicaServer`` builds the parts for Serve and starts them.
    """

    def __init__(
        self,
        config: PrefixmeshConfig,
        replica_id: ReplicaId,
        engine: Engine,
        publisher: EventPublisher,
        *,
        registry: CacheRegistry | None = None,
        holds: ReplicaHolds | None = None,
        fair: FairGate | None = None,
        progress: ProgressReporter | None = None,
        shared_tier: SharedTierPublisher | None = None,
        runtime: RuntimeWatch | None = None,
        runtime_metrics: PrometheusSink | None = None,
    ) -> None:
        """``registry``: the shared registry this replica's client talks to (None: the
        in-process one, reached through the ingress); ``holds``: from the config when not
        given; ``fair``: the fair-share gate (None: every request equal); ``progress``: the
        reporter of first tokens and ends to the router; ``runtime`` and ``runtime_metrics``:
        the GC, loop and token-interval watch and the sink it fills."""
        self.config = config
        self.replica_id = replica_id
        self.engine = engine
        self.publisher = publisher
        self._registry = registry
        self.holds = holds or ReplicaHolds(HoldSettings.from_config(config))
        self._resident = HeldMirror()
        """What the engine holds, from its changes: a hold waits only for blocks not here."""
        self.fair = fair
        self._coalesce = config.replica.coalesce_stream
        self.progress = progress
        self.shared_tier = shared_tier
        self.runtime = runtime
        self.runtime_metrics = runtime_metrics or PrometheusSink()
        """GC pauses, loop lag and the engine's token intervals: this replica's own text (the
        direct path's /metrics) and the cluster view."""
        self._prefill_tokens: dict[str, int] = {}
        self._prefill_attention_s: dict[str, float] = {}
        """The attention each queued prompt costs beyond the linear rate, for the part of it
        the engine did not hold when it arrived (only prompts that cost any)."""
        self._running: set[str] = set()
        self._finished: deque[str] = deque(maxlen=FINISHED_IDS_KEPT)

    def _on_changes(self, changes: Sequence[BlockChange]) -> None:
        self._resident.apply(changes)
        self.publisher.submit(changes)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        rid = request.request_id
        self._prefill_tokens[rid] = len(request.prompt_token_ids)
        attention_s = self._attention_s(request)
        if attention_s > 0:
            self._prefill_attention_s[rid] = attention_s
        trace = replica_trace(request, self.replica_id)  # no-op object when tracing is off
        in_prefill = True
        output_tokens = 0
        finish_reason: str | None = None
        announcement = _Announcement(self.engine, rid, request.key.block_hashes)
        try:
            held_s, engine_priority = await self._wait_turn(request, trace, announcement)
            self.holds.inflight.started(rid, request.key, len(request.prompt_token_ids))
            engine_request = EngineRequest(
                rid, request.prompt_token_ids, request.sampling, engine_priority
            )
            generate = self._coalesced if self._coalesce else self.engine.generate
            async for chunk in choice_chunks(generate, engine_request):
                if in_prefill:
                    in_prefill = False
                    self._first_token(rid)
                    trace.first_token(chunk.num_cached_tokens)
                output_tokens += len(chunk.token_ids)
                finish_reason = chunk.finish_reason
                yield GenerateChunk(
                    chunk.token_ids,
                    chunk.finished,
                    chunk.finish_reason,
                    chunk.num_cached_tokens,
                    self.replica_id,
                    held_s,
                    chunk.index,
                )
        except BaseException as exc:
            trace.failed(exc)
            raise
        finally:
            announcement.withdraw()
            self._left(rid, output_tokens)
            trace.end(output_tokens, finish_reason)

    def _coalesced(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        return coalesced(self.engine.generate(request))

    async def _wait_turn(
        self, request: GenerateRequest, trace: NoTrace, announcement: _Announcement
    ) -> tuple[float, int]:
        """Wait for the request's turn before the engine (its hold, then the fair-share gate):
        the seconds it was held, and the priority the engine schedules it at."""
        key = request.key
        hold = self.holds.hold_for(
            request.hold,
            key,
            lambda: self._resident.leading(key.block_hashes),
            self.capacity,
        )
        held_s = 0.0
        if hold is not None:
            announcement.waits_here()
            held_s = await self.holds.wait(hold, key, from_router=request.hold is not None)
        trace.queued(hold, held_s)
        engine_priority = 0  # every request equal: the engine's arrival order
        if self.fair is not None:
            start = await self.fair.enter(self._fair_ticket(request), announcement.waits_here)
            engine_priority = start.engine_priority
        announcement.withdraw()
        return held_s, engine_priority

    def _first_token(self, rid: str) -> None:
        """The request's first token came out: it is decoding now, its prefill is done."""
        if self.progress is not None:
            self.progress.first_token(rid)
        if self.fair is not None:
            self.fair.first_token(rid)
        self.holds.inflight.finished(rid)
        self._prefill_tokens.pop(rid, None)
        self._prefill_attention_s.pop(rid, None)
        self._running.add(rid)

    def _left(self, rid: str, output_tokens: int) -> None:
        """The request ended (finished, aborted or failed): every count of it goes."""
        if self.progress is not None:
            self.progress.finished(rid)
        if self.fair is not None:
            self.fair.leave(rid, output_tokens)
        self.holds.inflight.finished(rid)
        self._prefill_tokens.pop(rid, None)
        self._prefill_attention_s.pop(rid, None)
        self._running.discard(rid)
        self._finished.append(rid)

    def _attention_s(self, request: GenerateRequest) -> float:
        """What computing the prompt's blocks the engine does not hold costs in attention
        beyond the linear rate (0 on engines that report no such cost, such as vLLM)."""
        capacity = self.capacity()
        if capacity is None or capacity.attn_s_per_token_pair <= 0:
            return 0.0
        prompt = len(request.prompt_token_ids)
        cached = self._resident.leading(request.key.block_hashes) * request.key.block_size
        return capacity.prefill_attention_s(prompt, prompt - min(cached, prompt - 1))

    def _fair_ticket(self, request: GenerateRequest) -> FairTicket:
        """The request as fair share weighs it: the prompt tokens the engine must compute."""
        cached = self._resident.leading(request.key.block_hashes) * request.key.block_size
        work = max(1, len(request.prompt_token_ids) - cached)
        return FairTicket(request.request_id, request.tenant, request.priority, work)

    def capacity(self) -> ReplicaCapacity | None:
        """The engine's capacity (None if it reports none it knows, or one with a time or
        rate that is not a finite number)."""
        capacity: ReplicaCapacity | None = self.engine.capacity()
        return capacity if capacity is not None and capacity.usable() else None

    def report(self) -> ReplicaReport:
        """Load for routing, plus counters for tests and benchmarks."""
        load = self.engine.load()
        connector = dict(load.connector_stats)
        inflight = self.holds.inflight
        publisher = self.publisher
        capacity = self.capacity()
        return ReplicaReport(
            queued_requests=len(self._prefill_tokens),
            running_requests=len(self._running),
            pending_prefill_tokens=sum(self._prefill_tokens.values()),
            pending_attention_s=sum(self._prefill_attention_s.values()),
            kv_usage=load.kv_usage,
            capacity=capacity,
            # Routers that send requests past Serve's handle (the direct path) learn from this
            # which of theirs arrived here: those are in the counts above from now on.
            seen_requests=(*self._prefill_tokens, *self._running, *self._finished),
            counters=ReplicaCounters(
                epoch=publisher.epoch,
                engine_running_requests=load.running_requests,
                engine_waiting_requests=load.waiting_requests,
                prefix_cache_queries_tokens=load.prefix_cache_queries_tokens,
                prefix_cache_hit_tokens=load.prefix_cache_hit_tokens,
                external_prefix_cache_hit_tokens=load.external_prefix_cache_hit_tokens,
                layer_loads=connector.get("layer_loads", 0),
                async_loads=connector.get("async_loads", 0),
                holds=inflight.holds,
                hold_timeouts=inflight.hold_timeouts,
                published_events=publisher.published_events,
                published_resets=publisher.published_resets,
                resyncs=publisher.resyncs,
                heartbeat_mismatches=publisher.heartbeat_mismatches,
                reaped_replicas=publisher.reaped,
                event_gaps=load.event_gaps,
                fair_share_waits=self.fair.queue.waited if self.fair is not None else 0,
                fair_share_waiting=self.fair.queue.waiting if self.fair is not None else 0,
            ),
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """The report in its wire form (Serve polls this and hands it to the routers)."""
        return self.report().to_wire()

    def exported_spans(self, clear: bool = False) -> list[dict[str, Any]]:
        """Spans finished in this replica's process (``telemetry.tracing=memory``; else []),
        for tests and debugging through the deployment handle."""
        return tracing.finished_spans(clear)

    def registry_health(self) -> RegistryHealth:
        """What this replica's own registry client saw last (it publishes every few ms and
        heartbeats every second, so an unreachable Redis, a refused password or another
        cluster's fingerprint shows within a second); the in-process registry is healthy."""
        return self._registry.health if self._registry is not None else HEALTHY

    def unserved(self, request_id: str) -> None:
        """A request the router sent here ended before the engine saw it (refused at the
        door): the router counted it, so it hears that it ended (``generate`` reports the
        requests that reached the engine)."""
        if self.progress is not None:
            self.progress.finished(request_id)

    def runtime_registry(self) -> CollectorRegistry:
        """GC pauses, loop lag and the engine's token intervals up to now (drained at the
        call, not a second old): the direct path's ``/metrics`` renders it."""
        if self.runtime is not None:
            self.runtime.drain()
        return self.runtime_metrics.registry

    async def check_health(self) -> None:
        """Serve replaces a replica whose check raises: a dead engine fails every request."""
        if not self.engine.healthy():
            raise RuntimeError(f"replica {self.replica_id}: its engine is not healthy")

    async def shutdown(self) -> None:
        if self.runtime is not None:
            await self.runtime.stop()
        if self.progress is not None:
            await self.progress.stop()
        if self.shared_tier is not None:
            await self.shared_tier.stop()  # another replica takes its publishing over
        await self.publisher.stop()  # no heartbeat may race the final flush or the drop
        await self.publisher.flush()
        if self._registry is not None:
            # Leaving for good (scale-down, redeploy): take our entries along now rather than
            # leave routers to send our prefixes here until a reaper notices.
            await self._registry.drop_replica(self.replica_id)
        await self.engine.shutdown()
        if self._registry is not None:
            await self._registry.close()

    def __del__(self) -> None:
        # Serve calls __del__ on graceful stop; the engine's processes must not outlive us.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


class ReplicaServer(ReplicaCore):
    """The body of the Serve deployment (``prefixmesh.app`` wraps it with @serve.deployment):
    it builds the core's parts from the config and Serve's replica context (the registry
    connects, the engine starts), then starts them."""

    async def __init__(self, config_json: str, model_path: str, ingress_name: str) -> None:  # type: ignore[misc]
        from ray import serve

        config = PrefixmeshConfig.model_validate_json(config_json)
        tracing.setup(config.telemetry, "replica")
        context = serve.get_replica_context()
        replica_id = ReplicaId(context.replica_id.unique_id)
        rank_of: ReplicaRank | int = context.rank  # an int before Ray had ReplicaRank
        rank = rank_of.rank if hasattr(rank_of, "rank") else int(rank_of)
        registry: CacheRegistry | None = None
        target: EventTarget
        progress: ProgressReporter | None = None
        if config.registry.backend == "redis":
            registry = target = make_registry(config)
            await registry.connect()
        else:
            target = router = IngressEventTarget(config.app_name, ingress_name)
            if config.progress_to_router:
                interval_s = config.replica.publish_interval_ms / 1000
                progress = ProgressReporter(replica_id, router, interval_s)
        # The engine's changes reach the core built below (none come before it starts).
        engine = make_engine(config, model_path, rank, lambda changes: self._on_changes(changes))
        reg = config.registry
        publisher = EventPublisher(
            replica_id,
            target,
            engine.residency,
            interval_s=config.replica.publish_interval_ms / 1000,
            heartbeat_s=reg.heartbeat_interval_s,
            liveness=registry,
            # Redis is shared: every live replica reaps the silent ones (an atomic, idempotent
            # script), so a replica killed while idle leaves even if no router notices.
            reap_interval_s=reg.reap_interval_s if registry is not None else None,
            dead_after_s=reg.dead_after_s,
        )
        shared_tier: SharedTierPublisher | None = None
        if (folder := shared_tier_folder(config)) is not None:

            def shared_publisher(residency: Callable[[], Residency]) -> EventPublisher:
                return EventPublisher(
                    SHARED_TIER,
                    target,
                    residency,
                    interval_s=config.replica.publish_interval_ms / 1000,
                    heartbeat_s=reg.heartbeat_interval_s,
                    liveness=registry,
                )

            interval_s = config.kvcache.shared_scan_interval_s
            shared_tier = SharedTierPublisher(folder, shared_publisher, interval_s)
        runtime_metrics = PrometheusSink()
        runtime = RuntimeWatch(engine, RuntimeMetrics(Tee(runtime_metrics, serve_replica_sink())))
        super().__init__(
            config,
            replica_id,
            engine,
            publisher,
            registry=registry,
            fair=FairGate.from_config(config.replica.fair_share),
            progress=progress,
            shared_tier=shared_tier,
            runtime=runtime,
            runtime_metrics=runtime_metrics,
        )
        await engine.start()
        publisher.start()
        if shared_tier is not None:
            shared_tier.start()
        if progress is not None:
            progress.start()
        runtime.start()
        logger.info("replica %s (rank %d) ready", replica_id, rank)
