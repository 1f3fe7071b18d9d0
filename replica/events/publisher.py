"""Numbers a replica's cache changes into ``CacheEvent``s and ships them in batches.

Changes arrive synchronously from the engine (``submit``); a background task sends what has
accumulated every ``interval_s``. If the registry reports a gap, or a batch could not be
delivered, the publisher starts a new epoch whose first events are a snapshot of everything the
engine holds, in every tier (its own cache, and the CPU and disk tiers of our KV connector): the
registry purges the replica's old entries on the new epoch and rebuilds them from the snapshot,
so a lost batch heals itself instead of leaving the registry wrong.

An idle replica heartbeats: it asks the registry whether it still holds the replica's last
event, and resyncs on a "no" (the registry restarted, was flushed, or reaped it). With a shared
registry (Redis) each replica also reaps: replicas silent for ``dead_after_s`` are dropped, so a
replica killed while idle leaves no entries behind even if no router ever hears of its death.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from prefixmesh.cache_registry.sequencing import MAX_EPOCH
from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    EventKind,
    PublishResult,
    ReplicaId,
    Tier,
)
from prefixmesh.replica.engines.base import BlockChange, Residency
from prefixmesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.05
"""Wait before the first retry of a failed delivery or a resync; doubles up to the next one."""
_MAX_RETRY_S = 2.0
"""Longest wait between attempts while the registry is unreachable (bounds the time to heal
after it is back)."""


class EventTarget(Protocol):
    """Where batches go: a ``CacheRegistry`` (its ``publish``), or the ingress that keeps the
    in-process one. Like the registry's calls, it returns an awaitable (a coroutine function
    fits)."""

    def publish(self, events: Sequence[CacheEvent]) -> Awaitable[list[PublishResult]]: ...


class Liveness(Protocol):
    """The registry's liveness calls (``CacheRegistry.heartbeat`` and ``reap``), typed as the
    registry's: awaitables (a coroutine function fits)."""

    def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> Awaitable[bool | None]: ...

    def reap(self, dead_after_s: float) -> Awaitable[list[ReplicaId]]: ...


def new_epoch() -> int:
    """Microseconds since the Unix epoch: increases across restarts, fits a double exactly."""
    return min(time.time_ns() // 1000, MAX_EPOCH)


class EventPublisher:
    def __init__(
        self,
        replica_id: ReplicaId,
        target: EventTarget,
        residency: Callable[[], Residency],
        *,
        interval_s: float = 0.005,
        max_batch_events: int = 512,
        heartbeat_s: float = 1.0,
        liveness: Liveness | None = None,
        reap_interval_s: float | None = None,
        dead_after_s: float = 3.0,
    ) -> None:
        """``liveness``: where heartbeats go; without it a heartbeat is an empty ``stored``
        event, which a registry that lost this replica's state answers with a gap.
        ``reap_interval_s``: reap replicas silent for ``dead_after_s`` this often (None: never;
        only for a registry every replica shares)."""
        self.replica_id = replica_id
        self._target = target
        self._residency = residency
        self._interval_s = interval_s
        self._max_batch = max_batch_events
        self._heartbeat_s = heartbeat_s
        self._liveness = liveness
        self._reap_interval_s = reap_interval_s
        self._dead_after_s = dead_after_s
        self.epoch = new_epoch()
        self._next_seq = 0
        self._pending: list[CacheEvent] = []
        self._resync_needed = False
        self._acked: tuple[int, int] | None = None
        """(epoch, seq) of the last event the registry accepted: what a heartbeat checks."""
        self._next_heartbeat_at = 0.0
        self._heartbeat_retry_s = _FIRST_RETRY_S
        self._in_contact_since: float | None = None
        """Monotonic time since when every registry call has succeeded (None after a failure)."""
        self._next_reap_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.published_events = 0
        self.published_resets = 0
        """Acknowledged events that replaced this replica's whole view in the registry: a
        cleared cache, or a new epoch's first event (the registry purges the old epoch's
        entries). Tests wait for it: a count of entries need not drop when a reset lands, since
        the snapshot after it may hold as much as before."""
        self.resyncs = 0
        self.heartbeat_mismatches = 0
        self.reaped = 0

    def submit(self, changes: Sequence[BlockChange]) -> None:
        if self._resync_needed:
            return  # the coming snapshot covers them; nothing piles up during an outage
        for change in changes:
            self._pending.append(self._event(change.kind, change.tier, change.block_hashes))

    def _event(
        self, kind: EventKind, tier: Tier | None, blocks: tuple[BlockHash, ...]
    ) -> CacheEvent:
        event = CacheEvent(kind, self.replica_id, self._next_seq, self.epoch, tier, blocks)
        self._next_seq += 1
        return event

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        # While the registry is unreachable every attempt fails and asks for a resync, which
        # rebuilds the full snapshot: retrying at the publish interval (5 ms) would spend the
        # engine's CPU on snapshots nobody receives, so failed attempts back off.
        wait_s = self._interval_s
        while True:
            await asyncio.sleep(wait_s)
            try:
                await self._heartbeat_if_idle()
                await self.flush()
                await self._reap_if_due()
            except Exception:  # a registry problem must never stop publishing for good
                logger.exception("publishing cache events failed")
                self._resync_needed = True
                self._in_contact_since = None
            if self._resync_needed:
                wait_s = min(max(2 * wait_s, _FIRST_RETRY_S), _MAX_RETRY_S)
            else:
                wait_s = self._interval_s

    async def _heartbeat_if_idle(self) -> None:
        """After ``heartbeat_s`` with nothing delivered, check the registry is still in step."""
        now = time.monotonic()
        if self._pending or self._resync_needed or now < self._next_heartbeat_at:
            return
        if self._liveness is None or self._acked is None:
            # Nothing to check against (or no way to): an empty event registers this replica,
            # or, in a registry that lost its state, comes back as a gap.
            self.submit([BlockChange(EventKind.STORED, Tier.GPU)])
            self._next_heartbeat_at = now + self._heartbeat_s
            return
        in_step = await self._liveness.heartbeat(self.replica_id, *self._acked)
        now = time.monotonic()
        if in_step is None:  # unreachable: ask again soon, it may be back without its state
            self._in_contact_since = None
            self._next_heartbeat_at = now + self._heartbeat_retry_s
            self._heartbeat_retry_s = min(2 * self._heartbeat_retry_s, self._heartbeat_s)
            return
        self._heartbeat_retry_s = _FIRST_RETRY_S
        self._next_heartbeat_at = now + self._heartbeat_s
        if in_step:
            self._note_contact(now)
        else:
            self.heartbeat_mismatches += 1
            logger.info("registry is out of step with replica %s; resyncing", self.replica_id)
            self._resync_needed = True

    async def _reap_if_due(self) -> None:
        """Drop replicas the registry has not heard from for ``dead_after_s``.

        Only after this replica has been in contact for ``dead_after_s`` itself: after a registry
        outage every replica looks silent until its next heartbeat, and an early reaper would
        drop them all (they would resync, but the cluster would route cache-blind meanwhile).
        """
        if self._liveness is None or self._reap_interval_s is None:
            return
        now = time.monotonic()
        since = self._in_contact_since
        if now < self._next_reap_at or since is None or now - since < self._dead_after_s:
            return
        self._next_reap_at = now + self._reap_interval_s
        reaped = await self._liveness.reap(self._dead_after_s)
        if reaped:
            self.reaped += len(reaped)
            logger.info("replica %s reaped silent replicas %s", self.replica_id, reaped)

    def _note_contact(self, now: float) -> None:
        if self._in_contact_since is None:
            self._in_contact_since = now

    def _start_resync(self) -> None:
        """A new epoch whose first events are the full snapshot of what the engine holds: the
        engine tier first (even when empty: it registers the replica), then each lower tier."""
        self.epoch = max(new_epoch(), self.epoch + 1)
        self._next_seq = 0
        residency = self._residency()
        lower = [(tier, blocks) for tier, blocks in residency.tiers if tier is not Tier.GPU]
        snapshot = [(Tier.GPU, residency.blocks(Tier.GPU)), *lower]
        self._pending = [self._event(EventKind.STORED, tier, blocks) for tier, blocks in snapshot]
        self._resync_needed = False
        self.resyncs += 1
        logger.info(
            "replica %s resyncs the registry (%s)",
            self.replica_id,
            ", ".join(f"{len(blocks)} {tier.name} blocks" for tier, blocks in snapshot),
        )

    async def flush(self) -> None:
        if self._resync_needed:
            self._start_resync()
        while self._pending:
            batch = self._pending[: self._max_batch]
            results = await self._target.publish(batch)
            if any(r.failed for r in results):
                self._in_contact_since = None
            if any(r.needs_resync for r in results):
                self._resync_needed = True
                return
            del self._pending[: len(batch)]
            self.published_events += len(batch)
            self.published_resets += sum(
                event.kind is EventKind.CLEARED or event.seq == 0 for event in batch
            )
            self._acked = (batch[-1].epoch, batch[-1].seq)
            now = time.monotonic()
            self._note_contact(now)
            self._next_heartbeat_at = now + self._heartbeat_s  # a delivery proves life too
