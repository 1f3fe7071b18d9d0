"""Numbers a replica's cache changes into ``CacheEvent``s and ships them in batches.

Changes arrive synchronously from the engine (``submit``); a background task sends what has
accumulated every ``interval_s``. If the registry reports a gap, or a batch could not be
delivered, the publisher starts a new epoch whose first event is a snapshot of everything the
engine holds: the registry purges the replica's old entries on the new epoch and rebuilds them
from the snapshot, so a lost batch heals itself instead of leaving the registry wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
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
from prefixmesh.replica.engines.base import BlockChange

logger = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.05
"""Wait before the first retry of a failed delivery or a resync; doubles up to the next one."""
_MAX_RETRY_S = 2.0
"""Longest wait between attempts while the registry is unreachable (bounds the time to heal
after it is back)."""


class EventTarget(Protocol):
    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]: ...


def new_epoch() -> int:
    """Microseconds since the Unix epoch: increases across restarts, fits a double exactly."""
    return min(time.time_ns() // 1000, MAX_EPOCH)


class EventPublisher:
    def __init__(
        self,
        replica_id: ReplicaId,
        target: EventTarget,
        held_blocks: Callable[[], tuple[BlockHash, ...]],
        *,
        interval_s: float = 0.005,
        max_batch_events: int = 512,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self._target = target
        self._held_blocks = held_blocks
        self._interval_s = interval_s
        self._max_batch = max_batch_events
        self._heartbeat_ticks = max(1, round(heartbeat_s / interval_s))
        """Quiet publish ticks before an empty ``stored`` event goes out: a registry that lost
        this replica's state (Redis restarted) answers it with a gap, so an idle replica
        resyncs within about ``heartbeat_s`` instead of at its next cache change."""
        self.epoch = new_epoch()
        self._next_seq = 0
        self._pending: list[CacheEvent] = []
        self._resync_needed = False
        self._task: asyncio.Task[None] | None = None
        self.published_events = 0
        self.resyncs = 0

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        # While the registry is unreachable every attempt fails and asks for a resync, which
        # rebuilds the full snapshot: retrying at the publish interval (5 ms) would spend the
        # engine's CPU on snapshots nobody receives, so failed attempts back off.
        wait_s = self._interval_s
        quiet_ticks = 0
        while True:
            await asyncio.sleep(wait_s)
            quiet_ticks = 0 if self._pending else quiet_ticks + 1
            if quiet_ticks >= self._heartbeat_ticks:
                quiet_ticks = 0
                self.submit([BlockChange(EventKind.STORED, Tier.GPU)])
            try:
                await self.flush()
            except Exception:  # a registry problem must never stop publishing for good
                logger.exception("publishing cache events failed")
                self._resync_needed = True
            if self._resync_needed:
                wait_s = min(max(2 * wait_s, _FIRST_RETRY_S), _MAX_RETRY_S)
            else:
                wait_s = self._interval_s

    def _start_resync(self) -> None:
        """A new epoch whose first event is the full snapshot of what the engine holds."""
        self.epoch = max(new_epoch(), self.epoch + 1)
        self._next_seq = 0
        snapshot = self._event(EventKind.STORED, Tier.GPU, self._held_blocks())
        self._pending = [snapshot]
        self._resync_needed = False
        self.resyncs += 1
        logger.info(
            "replica %s resyncs the registry (%d blocks)",
            self.replica_id,
            len(snapshot.block_hashes),
        )

    async def flush(self) -> None:
        if self._resync_needed:
            self._start_resync()
        while self._pending:
            batch = self._pending[: self._max_batch]
            results = await self._target.publish(batch)
            if any(r.needs_resync for r in results):
                self._resync_needed = True
                return
            del self._pending[: len(batch)]
            self.published_events += len(batch)
