"""The ``Engine`` seam of a replica: token ids in, token ids out, cache events on the side.

The ingress tokenizes once and passes token ids, so the router's block keys and the engine's
blocks are computed from the same tokens; the ingress also detokenizes what comes back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.wire import ReplicaCapacity, SamplingSettings


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSettings
    priority: int = 0
    """Lower goes first, ties in arrival order (vLLM's ``priority``); set by the replica's fair
    share. An engine started without priority scheduling serves in arrival order."""


@dataclass(frozen=True, slots=True)
class EngineChunk:
    """New output tokens of one request (a delta), with what is known about it so far."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    """"stop" or "length" once finished, "abort" if the engine gave up on it."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (known from the first chunk on)."""
    index: int = 0
    """The choice of a request for several (``replica/engines/choices.py``)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own view of its load, for routing stats."""

    waiting_requests: int = 0
    running_requests: int = 0
    kv_usage: float = 0.0
    """Fraction of the engine-tier KV cache in use."""
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    external_prefix_cache_hit_tokens: int = 0
    """Prompt tokens loaded from the lower tiers by our KV connector (not in the hits above)."""
    event_gaps: int = 0
    """Times the engine's own cache-event stream lost events and the replica's view was
    cleared (vLLM's numbered ZMQ batches)."""
    connector_stats: tuple[tuple[str, int], ...] = ()
    """Our KV connector's counts since the engine started, and its states, by name
    (``replica/kvcache/connector_stats.py``; empty without tiers)."""


@dataclass(frozen=True, slots=True)
class BlockChange:
    """One change of what the engine holds, in our block keys (the publisher numbers them)."""

    kind: EventKind
    tier: Tier | None = Tier.GPU
    block_hashes: tuple[BlockHash, ...] = field(default=())


CacheChangeSink = Callable[[Sequence[BlockChange]], None]


class TokenIntervals:
    """The engine's own intervals between a request's consecutive output tokens, kept until
    someone takes them (bounded: nobody reading them costs at most ``limit`` floats)."""

    def __init__(self, limit: int = 16_384) -> None:
        self._intervals: deque[float] = deque(maxlen=limit)

    def add(self, intervals: Iterable[float]) -> None:
        self._intervals.extend(intervals)

    def take(self) -> tuple[float, ...]:
        taken = tuple(self._intervals)
        self._intervals.clear()
        return taken


class Engine(Protocol):
    kv_blocks: int
    """Engine-tier KV capacity in blocks (known after ``start``)."""

    def capacity(self) -> ReplicaCapacity | None:
        """What the engine can do, for routing (None: it does not know, e.g. a remote engine
        whose server reported none it could read). Built once per call from the engine's own
        numbers, never parsed again by the replica."""
        ...

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream the request's output; closing the iterator early aborts it in the engine."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def announce(self, request_id: str, blocks: Sequence[BlockHash]) -> None:
        """``request_id`` (its prompt's chained block hashes) waits at the replica before it
        reaches the engine (a delay-hit hold, the fair-share gate): the engine's cache policy
        may keep what it is about to need. A hint; it never blocks."""
        ...

    def withdraw(self, request_id: str) -> None:
        """It no longer waits at the replica (it is submitted now, or left)."""
        ...

    def load(self) -> EngineLoad: ...

    def residency(self) -> Residency:
        """Every block held now, in every tier (a resync snapshot; the engine tier's blocks are
        ``residency().blocks()``)."""
        ...

    def take_token_intervals(self) -> tuple[float, ...]:
        """Seconds between consecutive output tokens of each request, as the engine timed them,
        since the last call (what a stream's gaps are measured against)."""
        ...

    async def reset_prefix_cache(self) -> bool: ...

    def healthy(self) -> bool:
        """False once the engine can no longer serve (dead, or unreachable too long)."""
        ...

    async def shutdown(self) -> None: ...

    def close(self) -> None:
        """Synchronous best-effort teardown, for a replica's ``__del__``."""
        ...


@dataclass(frozen=True, slots=True)
class Residency:
    """Every block an engine holds, by tier: the content of a resync snapshot, so that a
    registry rebuilt from it knows the CPU and disk tiers too, not only the engine's cache."""

    tiers: tuple[tuple[Tier, tuple[BlockHash, ...]], ...] = ()
    """(tier, its blocks), each tier at most once, in tier order."""

    @classmethod
    def of(cls, blocks_by_tier: Mapping[Tier, Iterable[BlockHash]]) -> Residency:
        return cls(
            tuple(
                (tier, tuple(blocks_by_tier[tier]))
                for tier in sorted(blocks_by_tier)
                if blocks_by_tier[tier]
            )
        )

    def blocks(self, tier: Tier = Tier.GPU) -> tuple[BlockHash, ...]:
        for held_tier, blocks in self.tiers:
            if held_tier is tier:
                return blocks
        return ()

    def stored(self) -> list[BlockChange]:
        """One ``stored`` change per tier: what tells a registry that starts empty the same."""
        return [BlockChange(EventKind.STORED, tier, blocks) for tier, blocks in self.tiers]


class HeldMirror:
    """What an engine holds in each tier, rebuilt from its changes (the remote engine's view of
    its server; a replica's view of its own engine, for holds; the vLLM engine's view of its KV
    connector's tiers)."""

    def __init__(self) -> None:
        # insertion-ordered sets, one per tier
        self._tiers: dict[Tier, dict[BlockHash, None]] = {tier: {} for tier in Tier}

    def snapshot(self, residency: Residency) -> list[BlockChange]:
        """Replace everything; the changes that tell a registry the same."""
        self._tiers = {tier: dict.fromkeys(residency.blocks(tier)) for tier in Tier}
        return [BlockChange(EventKind.CLEARED, None), *self.residency().stored()]

    def apply(self, changes: Sequence[BlockChange]) -> None:
        for change in changes:
            if change.kind is EventKind.CLEARED:
                for tier in Tier if change.tier is None else (change.tier,):
                    self._tiers[tier].clear()
            elif change.tier is not None:
                held = self._tiers[change.tier]
                if change.kind is EventKind.STORED:
                    held.update(dict.fromkeys(change.block_hashes))
                else:
                    for block in change.block_hashes:
                        held.pop(block, None)

    def blocks(self, tier: Tier = Tier.GPU) -> tuple[BlockHash, ...]:
        return tuple(self._tiers[tier])

    def residency(self) -> Residency:
        return Residency.of(self._tiers)

    def clear(self) -> None:
        for held in self._tiers.values():
            held.clear()

    def leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of the chain's first blocks the engine tier holds, up to the first one it
        does not."""
        held = self._tiers[Tier.GPU]
        count = 0
        for block in block_hashes:
            if block not in held:
                break
            count += 1
        return count
