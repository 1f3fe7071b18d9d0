"""The sim engine: the cluster simulator's engine model run in real time.

A replica with no model and no accelerator that still batches, caches prefixes, evicts, holds
and streams with the timing of a named profile, so a 16-replica cluster runs on two cores for
routing experiments. The same ``EngineModel`` drives the discrete-event simulator; here an
asyncio task advances it on the wall clock (scaled by ``time_scale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.engines.base import (
    BlockChange,
    CacheChangeSink,
    EngineChunk,
    EngineLoad,
    EngineRequest,
    Residency,
    TokenIntervals,
)
from prefixmesh.replica.sim_model.engine import EngineModel
from prefixmesh.replica.sim_model.profile import EngineProfile
from prefixmesh.replica.sim_model.records import CacheChanged, Finished, FirstToken, SimRequest
from prefixmesh.tasks import cancel_and_wait
from prefixmesh.wire import ReplicaCapacity

# Output token ids are placeholders, cycled: ordinary merged tokens of a byte-level BPE (ids
# past the 256 byte tokens and a few special ones), which decode to text as they stream; single
# bytes above 0x7F would be held back by a detokenizer as incomplete characters until the end.
_FIRST_TOKEN_ID = 300
_TOKEN_ID_SPAN = 100


@dataclass
class _Stream:
    first: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    aborted: bool = False
    output_tokens: int = 0
    cached_tokens: int = 0
    """From the request's record when it finished (a one-token request finishes at once)."""


class SimEngine:
    def __init__(
        self,
        profile: EngineProfile,
        hasher: BlockHasher,
        sink: CacheChangeSink,
        *,
        tp_degree: int = 1,
        time_scale: float = 1.0,
    ) -> None:
        if profile.block_size != hasher.block_size:
            raise ValueError(
                f"profile {profile.name} has block size {profile.block_size}, but "
                f"cache.block_size is {hasher.block_size}: router keys would never match"
            )
        self.profile = profile
        self.model = EngineModel(profile, tp_degree)
        self.kv_blocks = self.model.cache.capacity_blocks
        self._hasher = hasher
        self._sink = sink
        self._scale = time_scale
        self._t0 = time.monotonic()
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._queries = 0
        self._hits = 0
        self._intervals = TokenIntervals()

    def _now(self) -> float:
        """Model time: wall seconds since start, divided by the time scale."""
        return (time.monotonic() - self._t0) / self._scale

    async def start(self) -> None:
        self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        while True:
            next_s = self.model.next_event_s()
            timeout = None if next_s is None else max(0.0, (next_s - self._now()) * self._scale)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._handle(self.model.advance(self._now()))

    def _handle(self, events: list[CacheChanged | FirstToken | Finished]) -> None:
        changes: list[BlockChange] = []
        for event in events:
            if isinstance(event, CacheChanged):
                changes += [BlockChange(c.kind, c.tier, c.block_hashes) for c in event.changes]
            elif isinstance(event, FirstToken):
                stream = self._streams.get(event.request_id)
                if stream is not None:
                    stream.first.set()
            else:
                record = event.record
                self._queries += record.prompt_tokens
                self._hits += record.cached_tokens
                stream = self._streams.get(record.request_id)
                if stream is not None:
                    stream.finished = True
                    stream.aborted = record.aborted
                    stream.cached_tokens = record.cached_tokens
                    stream.first.set()
                    stream.progress.set()
        if changes:
            self._sink(changes)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        rid = request.request_id
        key = self._hasher.hash_tokens(request.prompt_token_ids)
        output_tokens = max(1, request.sampling.max_tokens)
        stream = self._streams[rid] = _Stream(output_tokens=output_tokens)
        self.model.submit(
            SimRequest(
                rid, key, len(request.prompt_token_ids), output_tokens, priority=request.priority
            ),
            self._now(),
        )
        self._wake.set()
        sent = 0
        try:
            await stream.first.wait()
            if stream.aborted:
                yield EngineChunk((), finished=True, finish_reason="abort")
                return
            record = self.model.record(rid)
            cached = record.cached_tokens if record is not None else stream.cached_tokens
            decode_wait_s = self.model.profile.step_overhead_s * self._scale
            last_token_s: float | None = None
            while True:
                produced = (
                    output_tokens
                    if stream.finished
                    else (self.model.generated_tokens(rid, self._now()))
                )
                if produced > sent or stream.finished:
                    now_s = time.monotonic()
                    if last_token_s is not None and produced > sent:
                        # Tokens that arrive together share the interval since the last ones.
                        share = (now_s - last_token_s) / (produced - sent)
                        self._intervals.add([share] * (produced - sent))
                    last_token_s = now_s
                    ids = tuple(
                        _FIRST_TOKEN_ID + (sent + i) % _TOKEN_ID_SPAN
                        for i in range(produced - sent)
                    )
                    yield EngineChunk(
                        ids, stream.finished, "length" if stream.finished else None, cached
                    )
                    sent = produced
                if stream.finished:
                    return
                stream.progress.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stream.progress.wait(), decode_wait_s)
        finally:
            if not stream.finished:
                self.model.abort(rid, self._now())
                self._wake.set()
            self._streams.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self.model.abort(request_id, self._now())
        self._wake.set()

    def announce(self, request_id: str, blocks: Sequence[BlockHash]) -> None:
        """Nothing: the engine model's CPU tier hears only of its own queue."""

    def withdraw(self, request_id: str) -> None:
        """Nothing (``announce``)."""

    def capacity(self) -> ReplicaCapacity:
        """In wall-clock terms: a time scale of 2 halves the rates and doubles the times."""
        profile, tp, scale = self.profile, self.model.tp_degree, self._scale
        return ReplicaCapacity(
            prefill_tokens_per_s=profile.prefill_tokens_per_s(tp) / scale,
            decode_step_s=profile.decode_step_s(1, 0, tp) * scale,
            max_batch_tokens=profile.max_batch_tokens,
            kv_blocks=self.kv_blocks,
            tp_degree=tp,
            cpu_load_s_per_block=profile.cpu_load_s_per_block * scale,
            attn_s_per_token_pair=profile.attn_s_per_token_ctx / profile.tp_speedup(tp) * scale,
        )

    def busy_s(self) -> float:
        """Wall seconds the engine has spent running steps since it started."""
        return self.model.busy_s * self._scale

    def load(self) -> EngineLoad:
        load = self.model.load()
        return EngineLoad(
            waiting_requests=load.queued_requests,
            running_requests=load.running_requests,
            kv_usage=load.active_kv_blocks / max(1, self.kv_blocks),
            prefix_cache_queries_tokens=self._queries,
            prefix_cache_hit_tokens=self._hits,
        )

    def take_token_intervals(self) -> tuple[float, ...]:
        return self._intervals.take()

    def residency(self) -> Residency:
        return Residency.of({Tier.GPU: self.model.cache.cached_blocks()})

    async def reset_prefix_cache(self) -> bool:
        removed = self.model.cache.clear_evictable()
        if removed:
            self._sink([BlockChange(EventKind.REMOVED, Tier.GPU, tuple(removed))])
        return True

    def healthy(self) -> bool:
        return True  # in-process and infallible: it lives exactly as long as the replica

    def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()

    async def shutdown(self) -> None:
        await cancel_and_wait(self._driver)
        self._driver = None
