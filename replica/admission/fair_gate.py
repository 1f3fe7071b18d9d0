"""The replica's fair-share gate: ``FairQueue`` in front of the engine, on the event loop.

``enter`` returns when the request may start (at once while the engine's prefill budget has
room), with the priority the engine orders it by; ``first_token`` and ``leave`` tell the queue,
which starts the next waiting requests. A request cancelled while it waits (client gone,
timeout) leaves the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from prefixmesh.config import FairShareConfig
from prefixmesh.replica.admission.fair_share import FairQueue, FairTicket


@dataclass(frozen=True, slots=True)
class FairStart:
    waited_s: float
    """Seconds the request waited at the gate."""
    engine_priority: int
    """What the engine orders it by (``EngineRequest.priority``)."""


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

    async def enter(
        self, ticket: FairTicket, on_wait: Callable[[], None] | None = None
    ) -> FairStart:
        """Wait until the request may start. ``on_wait`` is called first when it must wait."""
        rid = ticket.request_id
        started = self.queue.arrive(ticket)
        if rid in started:
            self._start(started)
            return FairStart(0.0, self.queue.engine_priority(rid))
        if on_wait is not None:
            on_wait()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[rid] = waiter
        self._start(started)
        began = loop.time()
        try:
            await waiter
        except BaseException:
            self._waiters.pop(rid, None)
            self.leave(rid, 0)
            raise
        return FairStart(loop.time() - began, self.queue.engine_priority(rid))

    def first_token(self, request_id: str) -> None:
        self._start(self.queue.first_token(request_id))

    def leave(self, request_id: str, output_tokens: int) -> None:
        self._start(self.queue.ended(request_id, output_tokens))

    def _start(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            waiter = self._waiters.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
