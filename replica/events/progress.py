"""Tells the router when each of this replica's requests reaches its first token and when it
ends, in batches (the direct path with the in-process registry).

On the proxy path Serve's handle calls the router back at both moments, and its ledger knows
each replica's load exactly. On the direct path nothing does, and a replica's periodic report is
up to a report period old: it still counts requests that have finished since, which pushed
prefixes away from their replicas (hit rate 87.7% against the proxy path's 94.1% in
``prefixmesh compare``), and a claim was released when the request arrived rather than when its
prefix was stored. The router applies these to its ledger (``LoadLedger.first_token`` and
``finished``); a batch that cannot be delivered goes back ahead of newer notes and is sent
again with the next one (a router's ledger ends entries only here, or by expiry 600 s later).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.tasks import cancel_and_wait
from prefixmesh.wire.request_progress import RequestProgress

logger = logging.getLogger(__name__)

MAX_PENDING = 16_384
"""Progress notes kept while the router cannot be reached (older ones are dropped first)."""


class ProgressTarget(Protocol):
    def request_progress(self, progress: RequestProgress) -> Awaitable[None]: ...


class ProgressReporter:
    def __init__(self, replica: ReplicaId, target: ProgressTarget, interval_s: float) -> None:
        self._replica = replica
        self._target = target
        self._interval_s = interval_s
        self._first_tokens: list[str] = []
        self._finished: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def first_token(self, request_id: str) -> None:
        self._note(self._first_tokens, request_id)

    def finished(self, request_id: str) -> None:
        self._note(self._finished, request_id)

    @staticmethod
    def _note(notes: list[str], request_id: str) -> None:
        notes.append(request_id)
        _bound(notes)

    def _put_back(self, progress: RequestProgress) -> None:
        """An undelivered batch, ahead of what was noted since (the oldest go first when
        the bound is reached)."""
        self._first_tokens = [*progress.first_tokens, *self._first_tokens]
        self._finished = [*progress.finished, *self._finished]
        _bound(self._first_tokens)
        _bound(self._finished)

    def take(self) -> RequestProgress | None:
        """What has accumulated since the last batch (None: nothing)."""
        if not self._first_tokens and not self._finished:
            return None
        progress = RequestProgress(self._replica, tuple(self._first_tokens), tuple(self._finished))
        self._first_tokens, self._finished = [], []
        return progress

    async def flush(self) -> None:
        progress = self.take()
        if progress is None:
            return
        try:
            await self._target.request_progress(progress)
        except Exception as exc:  # the router restarting or overloaded: sent again next time
            self._put_back(progress)
            logger.warning("router unreachable for request progress: %s", exc)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.flush()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self.flush()


def _bound(notes: list[str]) -> None:
    if len(notes) > MAX_PENDING:
        del notes[: len(notes) - MAX_PENDING]
