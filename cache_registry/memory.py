"""The in-process registry: one shared ``InMemoryStore`` per process, one client per user.

It is the registry of a single-machine cluster and the oracle the Redis backend is tested
against. Everything runs on the caller's event loop; no call blocks or does I/O. Holders are
bitmasks over replica indices (``holders.py``), so a 64 x 64 lookup costs tens of microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from prefixmesh.cache_registry.hashing import CacheFingerprint, FingerprintMismatchError
from prefixmesh.cache_registry.holders import ReplicaIndex, Row, RunSegment, count_segments
from prefixmesh.cache_registry.hotness import DecayedCount, rate_per_s, touched
from prefixmesh.cache_registry.protocol import group_by_replica
from prefixmesh.cache_registry.sequencing import SeqAction, SequenceState, check_sequence
from prefixmesh.cache_registry.types import (
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


@dataclass(slots=True)
class BlockEntry:
    """Who holds one block: a bitmask of replica indices per tier, and speculative holders."""

    tiers: list[int] = field(default_factory=lambda: [0, 0, 0])
    speculative: dict[int, float] = field(default_factory=dict)
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


@dataclass
class InMemoryStore:
    """The state several in-process clients share (what Redis holds for the Redis backend)."""

    fingerprint: CacheFingerprint | None = None
    replicas: ReplicaIndex = field(default_factory=ReplicaIndex)
    blocks: dict[BlockHash, BlockEntry] = field(default_factory=dict)
    replica_blocks: dict[ReplicaId, set[BlockHash]] = field(default_factory=dict)
    """Blocks each replica holds confirmed (what drop, clear and reset walk)."""
    replica_speculative: dict[ReplicaId, set[BlockHash]] = field(default_factory=dict)
    sequences: dict[ReplicaId, SequenceState] = field(default_factory=dict)
    inflight: dict[BlockHash, tuple[ReplicaId, float]] = field(default_factory=dict)
    released: dict[BlockHash, asyncio.Event] = field(default_factory=dict)
    hotness: dict[BlockHash, DecayedCount] = field(default_factory=dict)


class InMemoryRegistry:
    """``CacheRegistry`` over an ``InMemoryStore``."""

    def __init__(
        self,
        fingerprint: CacheFingerprint,
        store: InMemoryStore | None = None,
        *,
        clock: Clock = time.monotonic,
        max_holders_per_block: int = 64,
        hotness_half_life_s: float = 30.0,
    ) -> None:
        if max_holders_per_block < 1:
            raise ValueError("max_holders_per_block must be >= 1")
        self.fingerprint = fingerprint
        self.stats = RegistryStats()
        self.store = store if store is not None else InMemoryStore()
        self._clock = clock
        self._max_holders = max_holders_per_block
        self._half_life_s = hotness_half_life_s

    async def connect(self) -> None:
        if self.store.fingerprint is None:
            self.store.fingerprint = self.fingerprint
        elif self.store.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"registry holds {self.store.fingerprint.to_json()}, "
                f"this process uses {self.fingerprint.to_json()}"
            )

    async def close(self) -> None:
        return None

    # ---- lookups ---------------------------------------------------------------------------

    async def lookup(
        self, key: PrefixKey, replicas: Collection[ReplicaId], *, deadline_s: float
    ) -> dict[ReplicaId, PrefixHit]:
        self.stats.lookups += 1
        index = self.store.replicas
        alive = index.mask_of(set(replicas)) if replicas else -1
        if not alive:
            return {}
        now = self._clock()
        blocks = self.store.blocks
        segments: list[RunSegment] = []
        previous: tuple[int, int, int, int] | None = None
        run = 0
        for block in key.block_hashes:
            entry = blocks.get(block)
            if entry is None:
                break
            gpu, cpu, disk = entry.tiers
            speculative = entry.live_speculative(now) if entry.speculative else 0
            signature = (gpu, cpu, disk, speculative)
            if signature == previous:
                run += 1
                continue
            held = (gpu | cpu | disk | speculative) & alive
            if not held:
                break
            if run:
                segments.append(self._segment(previous, alive, run))
            previous, alive, run = signature, held, 1
        if run:
            segments.append(self._segment(previous, alive, run))
        hits: dict[ReplicaId, PrefixHit] = {}
        shared: dict[Row, PrefixHit] = {}  # replicas with equal rows share one value
        id_of = index.id_of
        for i, row in count_segments(segments).items():
            hit = shared.get(row)
            if hit is None:
                hit = shared[row] = PrefixHit(row[0] + row[1] + row[2], row[:3], row[3])
            hits[id_of[i]] = hit
        return hits

    @staticmethod
    def _segment(
        signature: tuple[int, int, int, int] | None, alive: int, length: int
    ) -> RunSegment:
        assert signature is not None
        gpu, cpu, disk, speculative = signature
        gpu &= alive
        cpu &= alive & ~gpu
        disk &= alive & ~gpu & ~cpu
        speculative &= alive & ~(gpu | cpu | disk)
        return RunSegment(gpu, cpu, disk, speculative, length)

    # ---- events ----------------------------------------------------------------------------

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        return [self._publish_replica(r, evs) for r, evs in group_by_replica(events).items()]

    def _publish_replica(self, replica: ReplicaId, events: list[CacheEvent]) -> PublishResult:
        applied = duplicates = 0
        gap = reset = False
        for event in events:
            decision = check_sequence(self.store.sequences.get(replica), event)
            if decision.action is SeqAction.SKIP:
                duplicates += 1
                continue
            if decision.action is SeqAction.RESET_AND_APPLY:
                self._purge(replica)
                reset = True
            gap = gap or decision.gap
            self.store.sequences[replica] = SequenceState(event.epoch, event.seq)
            self._apply(event)
            applied += 1
        return PublishResult(replica, applied, duplicates, gap, reset)

    def _apply(self, event: CacheEvent) -> None:
        replica = event.replica_id
        index = self.store.replicas.assign(replica)
        if event.kind is EventKind.CLEARED:
            tiers = list(Tier) if event.tier is None else [event.tier]
            for block in list(self.store.replica_blocks.get(replica, ())):
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
                self._forget_speculative(block, replica, index)

    def _add(self, block: BlockHash, replica: ReplicaId, index: int, tier: Tier) -> None:
        entry = self.store.blocks.get(block)
        if entry is None:
            entry = self.store.blocks[block] = BlockEntry()
        bit = 1 << index
        confirmed = entry.confirmed
        if not confirmed & bit:
            if confirmed.bit_count() >= self._max_holders:
                # An existing holder makes room (the lowest index, as Redis takes the first).
                victim = (confirmed & -confirmed).bit_length() - 1
                victim_id = self.store.replicas.id_of[victim]
                for other_tier in Tier:
                    self._remove(block, victim_id, victim, other_tier)
                entry = self.store.blocks.setdefault(block, entry)
            self.store.replica_blocks.setdefault(replica, set()).add(block)
        entry.tiers[tier] |= bit

    def _remove(self, block: BlockHash, replica: ReplicaId, index: int, tier: Tier) -> None:
        entry = self.store.blocks.get(block)
        bit = 1 << index
        if entry is None or not entry.tiers[tier] & bit:
            return
        entry.tiers[tier] &= ~bit
        if entry.confirmed & bit:
            return
        owned = self.store.replica_blocks.get(replica)
        if owned is not None:
            owned.discard(block)
            if not owned:
                del self.store.replica_blocks[replica]
        if entry.empty:
            del self.store.blocks[block]

    def _purge(self, replica: ReplicaId) -> None:
        index = self.store.replicas.index_of.get(replica)
        if index is None:
            return
        for block in list(self.store.replica_blocks.get(replica, ())):
            for tier in Tier:
                self._remove(block, replica, index, tier)
        self._drop_speculative(replica, index)

    # ---- speculative entries ---------------------------------------------------------------

    async def add_speculative(self, key: PrefixKey, replica: ReplicaId, ttl_s: float) -> None:
        now = self._clock()
        index = self.store.replicas.assign(replica)
        owned = self.store.replica_speculative.setdefault(replica, set())
        for block in [b for b in owned if self.store.blocks[b].speculative[index] <= now]:
            self._forget_speculative(block, replica, index)
        owned = self.store.replica_speculative.setdefault(replica, set())
        for block in key.block_hashes:
            entry = self.store.blocks.get(block)
            if entry is None:
                entry = self.store.blocks[block] = BlockEntry()
            entry.speculative[index] = now + ttl_s
            owned.add(block)

    def _forget_speculative(self, block: BlockHash, replica: ReplicaId, index: int) -> None:
        entry = self.store.blocks.get(block)
        if entry is None or entry.speculative.pop(index, None) is None:
            return
        if entry.empty:
            del self.store.blocks[block]
        owned = self.store.replica_speculative.get(replica)
        if owned is not None:
            owned.discard(block)
            if not owned:
                del self.store.replica_speculative[replica]

    def _drop_speculative(self, replica: ReplicaId, index: int) -> None:
        for block in list(self.store.replica_speculative.get(replica, ())):
            self._forget_speculative(block, replica, index)

    # ---- in-flight claims ------------------------------------------------------------------

    def _live_claim(self, prefix: BlockHash) -> ReplicaId | None:
        claim = self.store.inflight.get(prefix)
        if claim is None:
            return None
        if claim[1] <= self._clock():
            self._release(prefix)
            return None
        return claim[0]

    async def claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float
    ) -> ReplicaId | None:
        holder = self._live_claim(prefix)
        if holder is not None:
            return holder
        self.store.inflight[prefix] = (replica, self._clock() + ttl_s)
        return replica

    async def inflight(self, prefix: BlockHash) -> ReplicaId | None:
        return self._live_claim(prefix)

    async def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> bool:
        if self._live_claim(prefix) != replica:
            return False
        self._release(prefix)
        return True

    def _release(self, prefix: BlockHash) -> None:
        self.store.inflight.pop(prefix, None)
        event = self.store.released.pop(prefix, None)
        if event is not None:
            event.set()

    async def wait_released(self, prefix: BlockHash, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._live_claim(prefix) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            event = self.store.released.setdefault(prefix, asyncio.Event())
            # Wake at the claim's own expiry too, so an abandoned claim frees its waiters.
            until_expiry = self.store.inflight[prefix][1] - self._clock()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, max(0.0, until_expiry)))
        return True

    # ---- hotness ---------------------------------------------------------------------------

    async def touch(self, group: BlockHash, weight: float = 1.0) -> None:
        self.store.hotness[group] = touched(
            self.store.hotness.get(group), weight, self._clock(), self._half_life_s
        )

    async def rate(self, group: BlockHash) -> float:
        return rate_per_s(self.store.hotness.get(group), self._clock(), self._half_life_s)

    # ---- membership ------------------------------------------------------------------------

    async def drop_replica(self, replica: ReplicaId) -> None:
        self._purge(replica)
        self.store.sequences.pop(replica, None)
        self.store.replicas.release(replica)
        for prefix, (holder, _) in list(self.store.inflight.items()):
            if holder == replica:
                self._release(prefix)

    async def known_replicas(self) -> set[ReplicaId]:
        return set(self.store.sequences)
