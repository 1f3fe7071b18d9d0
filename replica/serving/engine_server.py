"""One engine served over HTTP: the server side of the remote engine's protocol
(``replica/engines/remote_engine.py``), its cache-event stream, counters and ``/metrics``.

``EngineHost`` owns an ``Engine`` and is its cache-change sink; ``engine_routes`` mounts the
native protocol (``/engine/*``), the prefix-cache counters in vLLM's metric names, the cache
reset (``/reset_prefix_cache``, and SGLang's ``/flush_cache``) and SGLang's ``/get_load``.
``prefixmesh replica-server`` puts the OpenAI API next to them.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from prefixmesh.metrics.runtime import RuntimeMetrics
from prefixmesh.metrics.sink import PrometheusSink
from prefixmesh.replica.engines.base import (
    BlockChange,
    Engine,
    EngineChunk,
    EngineRequest,
    Residency,
)
from prefixmesh.replica.engines.remote_engine import (
    decode_request,
    encode_changes,
    encode_chunk,
    encode_load,
    encode_residency,
)
from prefixmesh.replica.serving.runtime_watch import RuntimeWatch

LOAD_INTERVAL_S = 0.25
"""How often the cache-event stream carries the engine's load when nothing else happens."""
MAX_QUEUED_BATCHES = 100_000
"""A subscriber this far behind is cut off; it reconnects and starts from a snapshot."""


@dataclass(eq=False)
class _Subscriber:
    snapshot: Residency
    pending: deque[Sequence[BlockChange]] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    broken: bool = False


TTFT_BUCKETS_S = tuple(round(0.005 * 1.1**i, 6) for i in range(100))
"""5 ms to ~60 s in 10% steps: fine enough to read a median off (``prefixmesh compare``)."""


@dataclass
class Counters:
    """What the server saw, whichever API a request came through."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_sum_s: float = 0.0
    """Arrival at this server to the engine's first token, summed."""
    ttft_count: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))
    """Count of first tokens at or under each of ``TTFT_BUCKETS_S`` (not cumulative)."""
    running: int = 0


def _line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":")) + "\n").encode()


class EngineHost:
    """An engine, the subscribers to its cache changes, and the server's counters.

    Build it first and hand it to the engine as its sink (``host.sink``), then ``attach`` the
    engine. A subscriber's snapshot and its first change are taken in one step of the event
    loop, so nothing falls between them.
    """

    def __init__(self, model: str, replica_id: str) -> None:
        self.model = model
        self.replica_id = replica_id
        self.engine: Engine | None = None
        self.counters = Counters()
        self._subscribers: set[_Subscriber] = set()
        self._runtime: RuntimeWatch | None = None
        self._runtime_text = PrometheusSink()

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def live_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("no engine attached")
        return self.engine

    def watch_runtime(self) -> None:
        """Once the engine has started: GC pauses, loop lag and the engine's token intervals
        (in ``/metrics``); the startup heap frozen out of garbage collection."""
        self._runtime = RuntimeWatch(self.live_engine, RuntimeMetrics(self._runtime_text))
        self._runtime.start()

    async def stop_watching(self) -> None:
        if self._runtime is not None:
            await self._runtime.stop()
            self._runtime = None

    # ---- cache events --------------------------------------------------------------------------

    def sink(self, changes: Sequence[BlockChange]) -> None:
        for sub in self._subscribers:
            if len(sub.pending) >= MAX_QUEUED_BATCHES:
                sub.broken = True
                sub.pending.clear()
            elif not sub.broken:
                sub.pending.append(changes)
            sub.wake.set()

    async def events(self) -> AsyncIterator[bytes]:
        """NDJSON: a snapshot first, then batches of changes, with the load every so often."""
        engine = self.live_engine
        sub = _Subscriber(engine.residency())
        self._subscribers.add(sub)
        try:
            snapshot = encode_residency(sub.snapshot)
            yield _line({"snapshot": snapshot, "load": encode_load(engine.load())})
            while not sub.broken:
                if not sub.pending:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), LOAD_INTERVAL_S)
                    except TimeoutError:
                        yield _line({"load": encode_load(engine.load())})
                        continue
                batch: list[BlockChange] = []
                while sub.pending:
                    batch.extend(sub.pending.popleft())
                if batch and not sub.broken:
                    load = encode_load(engine.load())
                    yield _line({"changes": encode_changes(batch), "load": load})
        finally:
            self._subscribers.discard(sub)

    # ---- generation ------------------------------------------------------------------------------

    def track(self, request: EngineRequest) -> Callable[[EngineChunk | None], None]:
        """Count a request; the returned callback takes each chunk, then None at the end."""
        counters = self.counters
        counters.requests += 1
        counters.running += 1
        counters.prompt_tokens += len(request.prompt_token_ids)
        started = time.monotonic()
        state = {"first": True}

        def on_chunk(chunk: EngineChunk | None) -> None:
            if chunk is None:
                counters.running -= 1
                if state["first"]:
                    counters.failed += 1
                return
            if state["first"]:
                state["first"] = False
                ttft = time.monotonic() - started
                counters.ttft_sum_s += ttft
                counters.ttft_count += 1
                bucket = bisect.bisect_left(TTFT_BUCKETS_S, ttft)
                if bucket < len(TTFT_BUCKETS_S):
                    counters.ttft_buckets[bucket] += 1
            counters.generation_tokens += len(chunk.token_ids)

        return on_chunk

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The engine's stream for ``request``, counted."""
        return self._counted(request, self.live_engine.generate(request))

    async def _counted(
        self, request: EngineRequest, chunks: AsyncIterator[EngineChunk]
    ) -> AsyncIterator[EngineChunk]:
        on_chunk = self.track(request)
        try:
            async for chunk in chunks:
                on_chunk(chunk)
                yield chunk
        finally:
            on_chunk(None)
            await chunks.aclose()  # type: ignore[attr-defined]  # aborts it in the engine

    async def generate_response(self, data: dict[str, Any]) -> Response:
        """``POST /engine/generate``: NDJSON chunks; the status waits for the first chunk, so a
        request the engine refuses is a 503, not a broken stream."""
        chunks = self.generate(decode_request(data))
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return JSONResponse({"error": "the engine produced nothing"}, status_code=503)
        except Exception as exc:
            await chunks.aclose()  # type: ignore[attr-defined]
            return JSONResponse({"error": f"the engine failed: {exc}"}, status_code=503)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield _line(encode_chunk(first))
                async for chunk in chunks:
                    yield _line(encode_chunk(chunk))
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(body(), media_type="application/x-ndjson")

    # ---- reports ---------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        engine = self.live_engine
        load = engine.load()
        c = self.counters
        vllm = f'model_name="{self.model}",engine="0"'
        ours = f'replica="{self.replica_id}"'
        samples: list[tuple[str, str, str, float]] = [
            ("vllm:prefix_cache_queries_total", "counter", vllm, load.prefix_cache_queries_tokens),
            ("vllm:prefix_cache_hits_total", "counter", vllm, load.prefix_cache_hit_tokens),
            (
                "vllm:external_prefix_cache_hits_total",
                "counter",
                vllm,
                load.external_prefix_cache_hit_tokens,
            ),
            ("vllm:num_requests_running", "gauge", vllm, load.running_requests),
            ("vllm:num_requests_waiting", "gauge", vllm, load.waiting_requests),
            ("vllm:kv_cache_usage_perc", "gauge", vllm, load.kv_usage),
            ("prefixmesh_replica_requests_total", "counter", ours, c.requests),
            ("prefixmesh_replica_failed_requests_total", "counter", ours, c.failed),
            ("prefixmesh_replica_prompt_tokens_total", "counter", ours, c.prompt_tokens),
            ("prefixmesh_replica_generation_tokens_total", "counter", ours, c.generation_tokens),
            ("prefixmesh_replica_ttft_seconds_sum", "counter", ours, c.ttft_sum_s),
            ("prefixmesh_replica_ttft_seconds_count", "counter", ours, c.ttft_count),
            ("prefixmesh_replica_in_flight", "gauge", ours, c.running),
            ("prefixmesh_replica_cached_blocks", "gauge", ours, len(engine.residency().blocks())),
        ]
        busy = getattr(engine, "busy_s", None)
        if callable(busy):  # the sim engine knows how long its steps ran
            busy_name = "prefixmesh_replica_engine_busy_seconds_total"
            samples.append((busy_name, "counter", ours, busy()))
        lines = [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in prompt tokens.",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in prompt tokens.",
            "# HELP prefixmesh_replica_ttft_seconds_sum Arrival here to the first token.",
        ]
        for name, kind, labels, value in samples:
            lines += [f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
        lines.append("# TYPE prefixmesh_replica_ttft_seconds_bucket counter")
        below = 0
        for bound, count in zip(TTFT_BUCKETS_S, c.ttft_buckets, strict=True):
            below += count
            lines.append(f'prefixmesh_replica_ttft_seconds_bucket{{{ours},le="{bound}"}} {below}')
        if self._runtime is not None:
            self._runtime.drain()
        return "\n".join(lines) + "\n" + self._runtime_text.render()

    def sglang_load(self) -> list[dict[str, Any]]:
        engine = self.live_engine
        load = engine.load()
        return [
            {
                "dp_rank": 0,
                "num_reqs": load.running_requests + load.waiting_requests,
                "num_waiting_reqs": load.waiting_requests,
                "num_tokens": int(load.kv_usage * engine.kv_blocks),
            }
        ]


def engine_routes(host: EngineHost, info: Callable[[], dict[str, Any]]) -> APIRouter:
    """The native protocol, metrics, cache reset and load endpoints of one engine."""
    routes = APIRouter()

    @routes.get("/engine/info")
    async def engine_info() -> dict[str, Any]:
        return info()

    @routes.post("/engine/generate")
    async def engine_generate(request: Request) -> Response:
        return await host.generate_response(await request.json())

    @routes.get("/engine/events")
    async def engine_events() -> StreamingResponse:
        return StreamingResponse(host.events(), media_type="application/x-ndjson")

    @routes.post("/engine/abort")
    async def engine_abort(request: Request) -> dict[str, bool]:
        await host.live_engine.abort(str((await request.json())["request_id"]))
        return {"ok": True}

    @routes.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(host.metrics_text(), media_type="text/plain; version=0.0.4")

    @routes.api_route("/reset_prefix_cache", methods=["GET", "POST"])
    @routes.api_route("/flush_cache", methods=["GET", "POST"])
    async def reset() -> PlainTextResponse:
        ok = await host.live_engine.reset_prefix_cache()
        return PlainTextResponse("Cache flushed.\n" if ok else "busy\n", 200 if ok else 409)

    @routes.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return host.sglang_load()

    @routes.get("/health")
    @routes.get("/health_generate")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    return routes
