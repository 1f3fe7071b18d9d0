"""The in-process registry: a synchronous ``RegistryState`` and its async facade.

``RegistryState`` is a pure core (no I/O, injected clock): the cluster simulator drives it
directly, and ``InMemoryRegistry`` clients share one per process. It is the registry of a
single-machine cluster and the oracle the Redis backend is tested against. Holders are bitmasks
over replica indices (``holders.py``), so a 64 x 64 lookup costs tens of microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from prefixmesh.cache_registry.hashing import CacheFingerprint, FingerprintMismatchError
from prefixmesh.cache_registry.holders import ReplicaIndex, Row, RunSegment, count_segments
from prefixmesh.cache_registry.hotness import DecayedCount, rate_per_s, touched
from prefixmesh.cache_registry.protocol import group_by_replica
from prefixmesh.cache_registry.registry_health import HEALTHY, RegistryHealth
from prefixmesh.cache_registry.sequencing import SeqAction, SequenceState, check_sequence
from prefixmesh.cache_registry.types import (
    DROPPED_REPLICA_MEMORY_S,
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixHit,
    PrefixKey,
    PublishResult,
    RegistryStats,
    ReplicaId,
    Tier,
)

Clock = Callable[[], float]
T = TypeVar("T")


class BlockEntry:
    """Who holds one block: a bitmask of replica indices per tier, and speculative holders.

    A plain slotted class, not a dataclass with default factories: the simulator creates one
    per new block of every routed prompt, and the factories' calls were most of that cost."""

    __slots__ = ("speculative", "tiers")

    def __init__(self) -> None:
        self.tiers = [0, 0, 0]
        self.speculative: dict[int, float] = {}
        """Replica index -> expiry (clock seconds) of routing-time entries."""

    @property
    def confirmed(self) -> int:
        return self.tiers[0] | self.tiers[1] | self.tiers[2]

    def live_speculative(self, now: float) -> int:
        mask = 0
        for index, expiry in self.speculative.items():
            if expiry > now:
                mask |= 1 << index
        return mask

    @property
    def empty(self) -> bool:
        return not self.confirmed and not self.speculative


class RegistryState:
    """Everything a registry holds, with synchronous operations (what Redis holds and does)."""

    def __init__(
        self,
        *,
        clock: Clock = time.monotonic,
        max_holders_per_block: int = 64,
        hotness_half_life_s: float = 30.0,
    ) -> None:
        if max_holders_per_block < 1:
            raise ValueError("max_holders_per_block must be >= 1")
        self.clock = clock
        self.max_holders = max_holders_per_block
        self.half_life_s = hotness_half_life_s
        self.fingerprint: CacheFingerprint | None = None
        self.replicas = ReplicaIndex()
        self.blocks: dict[BlockHash, BlockEntry] = {}
        self.replica_blocks: dict[ReplicaId, set[BlockHash]] = {}
        """Blocks each replica holds confirmed (what drop, clear and reset walk)."""
        self.replica_speculative: dict[ReplicaId, list[tuple[float, tuple[BlockHash, ...]]]] = {}
        """Each replica's speculative writes as a heap by expiry (expiry, blocks), as Redis's
        sorted set: expiring them pops the earliest instead of scanning, whatever each write's
        lifetime. An entry already forgotten (confirmed, removed, written again later) is
        skipped when its write comes up."""
        self.sequences: dict[ReplicaId, SequenceState] = {}
        self.dropped: dict[ReplicaId, float] = {}
        """Replicas dropped recently, until when (see DROPPED_REPLICA_MEMORY_S)."""
        self.last_seen: dict[ReplicaId, float] = {}
        """When each replica last published or heartbeat in step (what ``reap`` reads)."""
        self.inflight: dict[BlockHash, tuple[ReplicaId, float]] = {}
        self.hotness: dict[BlockHash, DecayedCount] = {}
        self._release_listeners: list[Callable[[BlockHash], None]] = []

    def check_fingerprint(self, fingerprint: CacheFingerprint) -> None:
        if self.fingerprint is None:
            self.fingerprint = fingerprint
        elif self.fingerprint != fingerprint:
            raise FingerprintMismatchError(
                f"registry holds {self.fingerprint.to_json()}, "
                f"this process uses {fingerprint.to_json()}"
            )

    # ---- lookups ---------------------------------------------------------------------------

    def lookup(self, key: PrefixKey, replicas: Collection[ReplicaId]) -> dict[ReplicaId, PrefixHit]:
        index = self.replicas
        alive = index.mask_of(set(replicas)) if replicas else -1
        if not alive:
            return {}
        now = self.clock()
        blocks = self.blocks
        segments: list[RunSegment] = []
        previous: tuple[int, int, int, int] | None = None
        previous_tiers: list[int] | None = None  # the run's tiers while it has no guesses
        run = 0
        for block in key.block_hashes:
            entry = blocks.get(block)
            if entry is None:
                break
            tiers = entry.tiers
            if not entry.speculative and tiers == previous_tiers:
                run += 1  # the common case, a long run of equal holders: no tuple built
                continue
            gpu, cpu, disk = tiers
            speculative = entry.live_speculative(now) if entry.speculative else 0
            signature = (gpu, cpu, disk, speculative)
            if signature == previous:
                run += 1
                continue
            previous_tiers = None if speculative else [gpu, cpu, disk]
            held = (gpu | cpu | disk | speculative) & alive
            if not held:
                break
            if run:
                segments.append(_segment(previous, alive, run))
            previous, alive, run = signature, held, 1
        if run:
            segments.append(_segment(previous, alive, run))
        hits: dict[ReplicaId, PrefixHit] = {}
        shared: dict[Row, PrefixHit] = {}  # replicas with equal rows share one value
        id_of = index.id_of
        for i, row in count_segments(segments).items():
            hit = shared.get(row)
            if hit is None:
                hit = shared[row] = PrefixHit(row[0] + row[1] + row[2], row[:3], row[3])
            hits[id_of[i]] = hit
        return hits

    # ---- events ----------------------------------------------------------------------------

    def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        return [self._publish_replica(r, evs) for r, evs in group_by_replica(events).items()]

    def _publish_replica(self, replica: ReplicaId, events: list[CacheEvent]) -> PublishResult:
        self.dropped.pop(replica, None)  # its own events: alive after all
        self.last_seen[replica] = self.clock()
        applied = duplicates = 0
        gap = reset = False
        for event in events:
            decision = check_sequence(self.sequences.get(replica), event)
            if decision.action is SeqAction.SKIP:
                duplicates += 1
                continue
            if decision.action is SeqAction.RESET_AND_APPLY:
                self._purge(replica)
                reset = True
            gap = gap or decision.gap
            self.sequences[replica] = SequenceState(event.epoch, event.seq)
            self._apply(event)
            applied += 1
        return PublishResult(replica, applied, duplicates, gap, reset)

    def _apply(self, event: CacheEvent) -> None:
        replica = event.replica_id
        index = self.replicas.assign(replica)
        if event.kind is EventKind.CLEARED:
            tiers = list(Tier) if event.tier is None else [event.tier]
            for block in list(self.replica_blocks.get(replica, ())):
                for tier in tiers:
                    self._remove(block, replica, index, tier)
            if event.tier in (None, Tier.GPU):
                self._drop_speculative(replica, index)
            return
        assert event.tier is not None  # CacheEvent guarantees it
        for block in event.block_hashes:
            if event.kind is EventKind.STORED:
                self._add(block, replica, index, event.tier)
            else:
                self._remove(block, replica, index, event.tier)
                self._forget_speculative((block,), index)

    def _add(self, block: BlockHash, replica: ReplicaId, index: int, tier: Tier) -> None:
        entry = self.blocks.get(block)
        if entry is None:
            entry = self.blocks[block] = BlockEntry()
        bit = 1 << index
        confirmed = entry.confirmed
        if not confirmed & bit:
            if confirmed.bit_count() >= self.max_holders:
                # An existing holder makes room (the lowest index, as Redis takes the first).
                victim = (confirmed & -confirmed).bit_length() - 1
                victim_id = self.replicas.id_of[victim]
                for other_tier in Tier:
                    self._remove(block, victim_id, victim, other_tier)
                entry = self.blocks.setdefault(block, entry)
            self.replica_blocks.setdefault(replica, set()).add(block)
        entry.tiers[tier] |= bit
        if tier is Tier.GPU:
            # Confirmed where the router guessed: the guess has served its purpose.
            entry.speculative.pop(index, None)

    def _remove(self, block: BlockHash, replica: ReplicaId, index: int, tier: Tier) -> None:
        entry = self.blocks.get(block)
        bit = 1 << index
        if entry is None or not entry.tiers[tier] & bit:
            return
        entry.tiers[tier] &= ~bit
        if entry.confirmed & bit:
            return
        owned = self.replica_blocks.get(replica)
        if owned is not None:
            owned.discard(block)
            if not owned:
                del self.replica_blocks[replica]
        if entry.empty:
            del self.blocks[block]

    def _purge(self, replica: ReplicaId) -> None:
        index = self.replicas.index_of.get(replica)
        if index is None:
            return
        for block in list(self.replica_blocks.get(replica, ())):
            for tier in Tier:
                self._remove(block, replica, index, tier)
        self._drop_speculative(replica, index)

    # ---- speculative entries ---------------------------------------------------------------

    def add_speculative(self, key: PrefixKey, replica: ReplicaId, ttl_s: float) -> None:
        now = self.clock()
        dropped_until = self.dropped.get(replica)
        if dropped_until is not None:
            if dropped_until > now:
                return  # a late guess about a replica dropped since
            del self.dropped[replica]
        index = self.replicas.assign(replica)
        queue = self.replica_speculative.setdefault(replica, [])
        while queue and queue[0][0] <= now:
            expiry, written = heapq.heappop(queue)
            self._forget_speculative(written, index, expiry)
        expiry = now + ttl_s
        hashes = key.block_hashes
        blocks = self.blocks
        for block in hashes:
            entry = blocks.get(block)
            if entry is None:
                entry = blocks[block] = BlockEntry()
            entry.speculative[index] = expiry
        heapq.heappush(queue, (expiry, hashes))

    def _forget_speculative(
        self, blocks: Iterable[BlockHash], index: int, expiry: float | None = None
    ) -> None:
        """Drop the replica's speculative entries on ``blocks`` (only those written with
        ``expiry``, when given: a later write of the same block stands)."""
        entries = self.blocks
        for block in blocks:
            entry = entries.get(block)
            if entry is None:
                continue
            speculative = entry.speculative
            written = speculative.get(index)
            if written is None or (expiry is not None and written != expiry):
                continue
            del speculative[index]
            if not speculative and not (entry.tiers[0] | entry.tiers[1] | entry.tiers[2]):
                del entries[block]

    def _drop_speculative(self, replica: ReplicaId, index: int) -> None:
        for expiry, written in self.replica_speculative.pop(replica, ()):
            self._forget_speculative(written, index, expiry)

    # ---- in-flight claims ------------------------------------------------------------------

    def live_claim(self, prefix: BlockHash) -> tuple[ReplicaId, float] | None:
        """The holder and expiry of a live claim; an expired claim is released on sight."""
        claim = self.inflight.get(prefix)
        if claim is not None and claim[1] <= self.clock():
            self._release(prefix)
            return None
        return claim

    def claim_inflight(self, prefix: BlockHash, replica: ReplicaId, ttl_s: float) -> ReplicaId:
        claim = self.live_claim(prefix)
        if claim is not None:
            return claim[0]
        self.inflight[prefix] = (replica, self.clock() + ttl_s)
        return replica

    def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> bool:
        claim = self.live_claim(prefix)
        if claim is None or claim[0] != replica:
            return False
        self._release(prefix)
        return True

    def _release(self, prefix: BlockHash) -> None:
        self.inflight.pop(prefix, None)
        for listener in self._release_listeners:
            listener(prefix)

    def add_release_listener(self, listener: Callable[[BlockHash], None]) -> None:
        self._release_listeners.append(listener)

    def remove_release_listener(self, listener: Callable[[BlockHash], None]) -> None:
        self._release_listeners.remove(listener)

    # ---- hotness ---------------------------------------------------------------------------

    def touch(self, group: BlockHash, weight: float = 1.0) -> None:
        self.hotness[group] = touched(
            self.hotness.get(group), weight, self.clock(), self.half_life_s
        )

    def rate(self, group: BlockHash) -> float:
        return rate_per_s(self.hotness.get(group), self.clock(), self.half_life_s)

    # ---- membership ------------------------------------------------------------------------

    def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> bool:
        if self.sequences.get(replica) != SequenceState(epoch, seq):
            return False  # out of step (or unknown): not seen until its resync arrives
        self.last_seen[replica] = self.clock()
        return True

    def reap(self, dead_after_s: float) -> list[ReplicaId]:
        cutoff = self.clock() - dead_after_s
        dead = sorted(r for r, seen in self.last_seen.items() if seen < cutoff)
        for replica in dead:
            self.drop_replica(replica)
        return dead

    def drop_replica(self, replica: ReplicaId) -> None:
        self._purge(replica)
        self.sequences.pop(replica, None)
        self.last_seen.pop(replica, None)
        self.replicas.release(replica)
        now = self.clock()
        for expired in [r for r, until in self.dropped.items() if until <= now]:
            del self.dropped[expired]
        self.dropped[replica] = now + DROPPED_REPLICA_MEMORY_S
        for prefix, (holder, _) in list(self.inflight.items()):
            if holder == replica:
                self._release(prefix)


def _segment(signature: tuple[int, int, int, int] | None, alive: int, length: int) -> RunSegment:
    assert signature is not None
    gpu, cpu, disk, speculative = signature
    gpu &= alive
    cpu &= alive & ~gpu
    disk &= alive & ~gpu & ~cpu
    speculative &= alive & ~(gpu | cpu | disk)
    return RunSegment(gpu, cpu, disk, speculative, length)


class InMemoryRegistry:
    """``CacheRegistry`` over a ``RegistryState`` shared by the clients of one process.

    Every call does its work when it is made, under ``lock`` (the one the process's other users
    of the state take: the router shares it with the ingress that applies replicas' events),
    and returns a finished future. A caller that checks ``done()`` before awaiting never yields
    to the loop for it, so one router's decisions run through without interleaving and each
    sees the speculative entries of the decisions before it. ``wait_released`` alone waits.
    """

    def __init__(
        self,
        fingerprint: CacheFingerprint,
        state: RegistryState | None = None,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.stats = RegistryStats()
        self.state = state if state is not None else RegistryState()
        self._lock: AbstractContextManager[Any] = lock if lock is not None else nullcontext()
        self._released: dict[BlockHash, asyncio.Event] = {}
        self.state.add_release_listener(self._on_release)

    @property
    def available(self) -> bool:
        """In process: always."""
        return True

    @property
    def health(self) -> RegistryHealth:
        """In process: always healthy."""
        return HEALTHY

    def _now(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """``call``'s outcome as a finished future (on the running loop)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            with self._lock:
                future.set_result(call())
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _on_release(self, prefix: BlockHash) -> None:
        event = self._released.pop(prefix, None)
        if event is not None:
            event.set()

    async def connect(self) -> None:
        with self._lock:
            self.state.check_fingerprint(self.fingerprint)

    async def close(self) -> None:
        with self._lock:
            self.state.remove_release_listener(self._on_release)

    def lookup(
        self, key: PrefixKey, replicas: Collection[ReplicaId], *, deadline_s: float
    ) -> asyncio.Future[dict[ReplicaId, PrefixHit]]:
        self.stats.lookups += 1
        return self._now(lambda: self.state.lookup(key, replicas))

    def publish(self, events: Sequence[CacheEvent]) -> asyncio.Future[list[PublishResult]]:
        return self._now(lambda: self.state.publish(events))

    def add_speculative(
        self, key: PrefixKey, replica: ReplicaId, ttl_s: float
    ) -> asyncio.Future[None]:
        return self._now(lambda: self.state.add_speculative(key, replica, ttl_s))

    def claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float
    ) -> asyncio.Future[ReplicaId | None]:
        return self._now(lambda: self.state.claim_inflight(prefix, replica, ttl_s))

    def inflight(self, prefix: BlockHash) -> asyncio.Future[ReplicaId | None]:
        def holder() -> ReplicaId | None:
            claim = self.state.live_claim(prefix)
            return None if claim is None else claim[0]

        return self._now(holder)

    def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> asyncio.Future[bool]:
        return self._now(lambda: self.state.release_inflight(prefix, replica))

    async def wait_released(self, prefix: BlockHash, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                claim = self.state.live_claim(prefix)
                if claim is None:
                    return True
                event = self._released.setdefault(prefix, asyncio.Event())
                # Wake at the claim's own expiry too, so an abandoned claim frees its waiters.
                until_expiry = max(0.0, claim[1] - self.state.clock())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, until_expiry))

    def touch(self, group: BlockHash, weight: float = 1.0) -> asyncio.Future[None]:
        return self._now(lambda: self.state.touch(group, weight))

    def rate(self, group: BlockHash) -> asyncio.Future[float]:
        return self._now(lambda: self.state.rate(group))

    def drop_replica(self, replica: ReplicaId) -> asyncio.Future[None]:
        return self._now(lambda: self.state.drop_replica(replica))

    def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> asyncio.Future[bool | None]:
        return self._now(lambda: self.state.heartbeat(replica, epoch, seq))

    def reap(self, dead_after_s: float) -> asyncio.Future[list[ReplicaId]]:
        return self._now(lambda: self.state.reap(dead_after_s))

    def known_replicas(self) -> asyncio.Future[set[ReplicaId]]:
        return self._now(lambda: set(self.state.sequences))
