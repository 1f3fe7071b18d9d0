"""The remote engine: a Serve replica whose engine runs in a replica server over HTTP.

``prefixmesh replica-server`` runs one engine (sim or vLLM) behind the OpenAI API and behind a
small native protocol, token ids in and token ids out, defined here:

- ``GET  /engine/info``: the engine's cache fingerprint, KV capacity and timing capacity;
- ``POST /engine/generate``: one request (``encode_request``), answered as NDJSON, one
  ``encode_chunk`` object a line; closing the response aborts the request in the engine;
- ``GET  /engine/events``: a long-lived NDJSON stream; the first line is a snapshot of every
  block the engine holds, in every tier, then each batch of cache changes as it happens, and the
  engine's load every ``load_interval_s``;
- ``POST /engine/abort``, ``POST /reset_prefix_cache``.

With it, Ray Serve's request routers (ours and Ray's own) sit in front of the same engines as
routers that speak HTTP to workers (sglang-router, vllm-router): the Serve replica of rank r
forwards to replica server r and republishes that server's cache events to our registry, so our
router sees what the remote engine holds, with one HTTP hop of delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.engines.base import (
    BlockChange,
    CacheChangeSink,
    EngineChunk,
    EngineLoad,
    EngineRequest,
    HeldMirror,
    Residency,
)
from prefixmesh.tasks import cancel_and_wait
from prefixmesh.wire import ReplicaCapacity, SamplingSettings

logger = logging.getLogger(__name__)

_SEND_ATTEMPTS = 2
"""Tries of one generate call whose connection fails before any output (see ``generate``)."""


class RemoteEngineLost(ConnectionError):
    """The connection to the replica server failed or broke off (not a slow answer): the
    request can go to another replica if nothing reached the client (``router/front/retry.py``)."""


# ---- the wire format (shared with the replica server) ------------------------------------------


def encode_request(request: EngineRequest) -> dict[str, Any]:
    s = request.sampling
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        # Every field, as JSON takes it (a new one cannot be left off the wire).
        "sampling": {**dataclasses.asdict(s), "stop_token_ids": list(s.stop_token_ids)},
        "priority": request.priority,
    }


def decode_request(data: Mapping[str, Any]) -> EngineRequest:
    s = data["sampling"]
    sampling = SamplingSettings(
        max_tokens=int(s["max_tokens"]),
        temperature=float(s.get("temperature", 1.0)),
        top_p=float(s.get("top_p", 1.0)),
        seed=s.get("seed"),
        stop_token_ids=tuple(int(t) for t in s.get("stop_token_ids", ())),
        ignore_eos=bool(s.get("ignore_eos", False)),
        n=int(s.get("n", 1)),
        top_k=int(s.get("top_k", 0)),
        min_p=float(s.get("min_p", 0.0)),
        presence_penalty=float(s.get("presence_penalty", 0.0)),
        frequency_penalty=float(s.get("frequency_penalty", 0.0)),
        repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        min_tokens=int(s.get("min_tokens", 0)),
    )
    ids = tuple(int(t) for t in data["prompt_token_ids"])
    return EngineRequest(str(data["request_id"]), ids, sampling, int(data.get("priority", 0)))


def encode_chunk(chunk: EngineChunk) -> dict[str, Any]:
    return {
        "token_ids": list(chunk.token_ids),
        "finished": chunk.finished,
        "finish_reason": chunk.finish_reason,
        "num_cached_tokens": chunk.num_cached_tokens,
    }


def decode_chunk(data: Mapping[str, Any]) -> EngineChunk:
    return EngineChunk(
        tuple(data["token_ids"]),
        bool(data["finished"]),
        data.get("finish_reason"),
        int(data.get("num_cached_tokens", 0)),
    )


def encode_changes(changes: Sequence[BlockChange]) -> list[dict[str, Any]]:
    return [
        {
            "kind": c.kind.value,
            "tier": None if c.tier is None else int(c.tier),
            "blocks": list(c.block_hashes),
        }
        for c in changes
    ]


def decode_changes(data: Sequence[Mapping[str, Any]]) -> list[BlockChange]:
    return [
        BlockChange(
            EventKind(c["kind"]),
            None if c["tier"] is None else Tier(c["tier"]),
            tuple(BlockHash(int(h)) for h in c["blocks"]),
        )
        for c in data
    ]


def encode_residency(residency: Residency) -> list[list[Any]]:
    """``[[tier, [block, ...]], ...]``: a snapshot names every tier's blocks."""
    return [[int(tier), list(blocks)] for tier, blocks in residency.tiers]


def decode_residency(data: Sequence[Sequence[Any]]) -> Residency:
    return Residency.of({Tier(int(t)): [BlockHash(int(h)) for h in blocks] for t, blocks in data})


def encode_load(load: EngineLoad) -> dict[str, Any]:
    return {
        "waiting_requests": load.waiting_requests,
        "running_requests": load.running_requests,
        "kv_usage": load.kv_usage,
        "prefix_cache_queries_tokens": load.prefix_cache_queries_tokens,
        "prefix_cache_hit_tokens": load.prefix_cache_hit_tokens,
        "event_gaps": load.event_gaps,
    }


def decode_load(data: Mapping[str, Any]) -> EngineLoad:
    return EngineLoad(
        waiting_requests=int(data["waiting_requests"]),
        running_requests=int(data["running_requests"]),
        kv_usage=float(data["kv_usage"]),
        prefix_cache_queries_tokens=int(data["prefix_cache_queries_tokens"]),
        prefix_cache_hit_tokens=int(data["prefix_cache_hit_tokens"]),
        event_gaps=int(data.get("event_gaps", 0)),  # absent from older replica servers
    )


# ---- the engine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteEngineSettings:
    url: str
    """Base URL of the replica server."""
    connect_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    reconnect_interval_s: float = 0.5
    unhealthy_after_s: float = 5.0
    """Unhealthy once the server's event stream has been down, or silent, this long (the
    server sends its load every 0.25 s while the stream is open)."""


async def ndjson_lines(content: Any) -> AsyncIterator[bytes]:
    """The non-empty lines of an aiohttp body, however long (a cache snapshot is one line;
    aiohttp's own line reader refuses lines past its buffer limit)."""
    pending = bytearray()
    async for chunk in content.iter_any():
        pending += chunk
        end = pending.rfind(b"\n")
        if end < 0:
            continue
        lines = bytes(pending[:end]).split(b"\n")
        del pending[: end + 1]
        for line in lines:
            if line:
                yield line
    if pending.strip():
        yield bytes(pending)


class RemoteEngine:
    """An ``Engine`` that forwards to a replica server (see the module docstring).

    aiohttp, not httpx: its C parser reads a 32-token NDJSON stream for about 2.5 ms of CPU
    where httpx (pure-Python h11 and anyio) took 6.5 ms, on the replica's hot path."""

    def __init__(
        self,
        settings: RemoteEngineSettings,
        hasher: BlockHasher,
        sink: CacheChangeSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.kv_blocks = 0
        self._hasher = hasher
        self._sink = sink
        self._capacity: ReplicaCapacity | None = None
        self._load = EngineLoad()
        self._mirror = HeldMirror()
        self._session: Any = None
        self._events_task: asyncio.Task[None] | None = None
        self._clock = clock
        self._last_heard = clock()
        """When the event stream last opened or carried a line (the server's pulse)."""

    def _open_session(self) -> Any:
        import aiohttp

        # Idle pooled connections are dropped well before the server's keep-alive timeout
        # (uvicorn: 5 s by default, 30 s in replica-server), so we rarely reuse one it is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s, sock_connect=10.0)
        return aiohttp.ClientSession(self.url, connector=connector, timeout=timeout)

    async def start(self) -> None:
        self._session = self._open_session()
        info = await self._wait_for_info()
        ours = self._hasher.fingerprint.to_json()
        if info["fingerprint"] != ours:
            raise RuntimeError(
                f"replica server {self.url} hashes blocks as {info['fingerprint']}, this "
                f"cluster as {ours}: router keys would never match (align cache.* and model; "
                f"an unset cache.block_size is vLLM's under replica.engine=remote: set the "
                f"servers' there)"
            )
        self.kv_blocks = int(info["kv_blocks"])
        self._last_heard = self._clock()
        self._capacity = ReplicaCapacity.from_wire(info["capacity"])  # read once, here
        if self._capacity is None:
            raise RuntimeError(f"replica server {self.url} reports no readable capacity")
        self._events_task = asyncio.get_running_loop().create_task(self._follow_events())
        logger.info("remote engine %s: %d KV blocks", self.url, self.kv_blocks)

    async def _wait_for_info(self) -> dict[str, Any]:
        import aiohttp

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.connect_timeout_s
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=5.0)
                async with self._session.get("/engine/info", timeout=timeout) as response:
                    response.raise_for_status()
                    return dict(await response.json())
            except Exception as exc:
                if loop.time() > deadline:
                    raise RuntimeError(f"replica server {self.url} did not answer: {exc}") from exc
                await asyncio.sleep(0.2)

    async def _follow_events(self) -> None:
        """Mirror the server's cache; every (re)connection starts with a full snapshot, so a
        broken stream heals: the registry hears "cleared" and then everything held now."""
        import aiohttp

        forever = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
        while True:
            try:
                async with self._session.get("/engine/events", timeout=forever) as response:
                    response.raise_for_status()
                    self._last_heard = self._clock()
                    async for line in ndjson_lines(response.content):
                        self._last_heard = self._clock()
                        self._on_event(json.loads(line))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("cache events from %s broke off: %r", self.url, exc)
            await asyncio.sleep(self.settings.reconnect_interval_s)

    def _on_event(self, message: Mapping[str, Any]) -> None:
        if "snapshot" in message:
            self._sink(self._mirror.snapshot(decode_residency(message["snapshot"])))
        if "changes" in message:
            changes = decode_changes(message["changes"])
            self._mirror.apply(changes)
            self._sink(changes)
        if "load" in message:
            self._load = decode_load(message["load"])

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        import aiohttp

        body = encode_request(request)
        for attempt in range(_SEND_ATTEMPTS):
            started = False
            try:
                async with self._session.post("/engine/generate", json=body) as response:
                    if response.status != 200:
                        text = (await response.read()).decode(errors="replace")[:300]
                        raise RuntimeError(f"replica server {self.url}: {response.status} {text}")
                    async for line in ndjson_lines(response.content):
                        started = True
                        yield decode_chunk(json.loads(line))
                return
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                if isinstance(exc, asyncio.TimeoutError):  # slow, not gone: never resent
                    raise
                # A pooled connection that the server closed as we reused it fails before a
                # byte comes back; the server dropped the request with the connection (a
                # closed connection aborts it there), so sending it again is safe. Once
                # output has flowed, a retry would repeat it: the caller gets the error.
                if started or attempt + 1 == _SEND_ATTEMPTS:
                    raise RemoteEngineLost(f"replica server {self.url}: {exc!r}") from exc
                logger.warning("replica server %s: %r before any output; resending", self.url, exc)
        # Leaving the block early (the caller closed this generator) closes the connection,
        # which aborts the request in the remote engine.

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            async with self._session.post("/engine/abort", json={"request_id": request_id}):
                pass

    def announce(self, request_id: str, blocks: Sequence[BlockHash]) -> None:
        """Nothing: the remote engine's server takes no notices of waits."""

    def withdraw(self, request_id: str) -> None:
        """Nothing (``announce``)."""

    def capacity(self) -> ReplicaCapacity | None:
        return self._capacity

    def load(self) -> EngineLoad:
        return self._load

    def take_token_intervals(self) -> tuple[float, ...]:
        return ()  # the remote server's engine times its own tokens; they are not sent here

    def residency(self) -> Residency:
        return self._mirror.residency()

    async def reset_prefix_cache(self) -> bool:
        async with self._session.post("/reset_prefix_cache") as response:
            return bool(response.status == 200)

    def healthy(self) -> bool:
        """The server was heard from less than ``unhealthy_after_s`` ago: a restart on the same
        port stays healthy, a server that is gone or stalled does not."""
        return self._clock() - self._last_heard <= self.settings.unhealthy_after_s

    def close(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()

    async def shutdown(self) -> None:
        await cancel_and_wait(self._events_task)
        self._events_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
