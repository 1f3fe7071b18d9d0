"""The replica's fair-share gate: ``FairQueue`` in front of the engine, on the event loop.

``enter`` returns when the request may start (at once while the engine's prefill budget has
room); ``first_token`` and ``leave`` tell the queue, which starts the next waiting requests.
A request cancelled while it waits (client gone, timeout) leaves the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prefixmesh.config import FairShareConfig
from prefixmesh.replica.fair_share import FairQueue, FairTicket


class FairGate:
    def __init__(self, queue: FairQueue) -> None:
        self.queue = queue
        self._waiters: dict[str, asyncio.Future[None]] = {}

    @classmethod
    def from_config(cls, fair_share: FairShareConfig) -> FairGate | None:
        if not fair_share.enabled:
            return None
        return cls(
            FairQueue(
                fair_share.prefill_budget_tokens,
                fair_share.output_weight,
                fair_share.idle_credit_tokens,
            )
        )

    async def enter(self, ticket: FairTicket, on_wait: Callable[[], None] | None = None) -> float:
        """Wait until the request may start; returns the seconds it waited. ``on_wait`` is
        called first when it must wait."""
        started = self.queue.arrive(ticket)
        if ticket.request_id in started:
            self._start(started)
            return 0.0
        if on_wait is not None:
            on_wait()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[ticket.request_id] = waiter
        self._start(started)
        began = loop.time()
        try:
            await waiter
        except BaseException:
            self._waiters.pop(ticket.request_id, None)
            self.leave(ticket.request_id, 0)
            raise
        return loop.time() - began

    def first_token(self, request_id: str) -> None:
        self._start(self.queue.first_token(request_id))

    def leave(self, request_id: str, output_tokens: int) -> None:
        self._start(self.queue.ended(request_id, output_tokens))

    def _start(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            waiter = self._waiters.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
