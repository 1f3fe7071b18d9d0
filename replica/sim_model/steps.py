"""A request's state inside the engine model (``engine.py``) and the steps in progress.

``ModelRequest`` is what the model keeps per request (its place in the lifecycle ``WAITING`` ->
``HELD`` -> ``PREFILL`` -> ``DECODE`` -> ``DONE``, hits, pins, reservations); ``Stretch`` is the
steps the engine is running (one step with prefill chunks, or a run of pure decode steps, with
the closed form of when each step ends); ``insert_in_order`` keeps a queue in priority order.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.sim_model.records import RequestRecord, SimRequest
from prefixmesh.wire.route_ticket import Hold

WAITING, HELD, PREFILL, DECODE, DONE = range(5)


class ModelRequest:
    __slots__ = (
        "aborting",
        "attention_s",
        "context",
        "decode_start",
        "estimate",
        "held_since",
        "hold",
        "hold_deadline_s",
        "num_computed",
        "num_hit",
        "pins",
        "private_blocks",
        "ready_s",
        "record",
        "reserved_blocks",
        "spec",
        "state",
    )

    def __init__(self, spec: SimRequest, record: RequestRecord, hold: Hold | None) -> None:
        self.spec = spec
        self.record = record
        self.hold = hold
        self.hold_deadline_s = record.arrival_s + hold.max_wait_s if hold else 0.0
        self.held_since = 0.0
        self.state = WAITING
        self.aborting = False
        self.estimate = 0  # pending prefill tokens counted for it while waiting
        self.attention_s = 0.0  # the pending attention counted for it
        self.num_hit = 0
        self.num_computed = 0
        self.pins: list[BlockHash] = []  # cached blocks it references
        self.private_blocks = 0
        self.reserved_blocks = 0
        self.context = 0  # tokens of KV it attends to while decoding
        self.decode_start = 0  # global decode counter when it started decoding
        self.ready_s = -math.inf  # when its lower-tier blocks are loaded (async loads)


@dataclass(slots=True)
class Stretch:
    """Steps in progress: one step with prefill chunks, or ``num_steps`` pure decode steps."""

    start_s: float
    num_steps: int
    first_step_s: float
    growth_s: float
    """Each further decode step takes this much longer (every decode's context grew by 1)."""
    batch: int
    """Decode tokens per step."""
    chunks: list[tuple[ModelRequest, int]]
    end_s: float = 0.0

    def elapsed_after(self, steps: int) -> float:
        return steps * self.first_step_s + self.growth_s * steps * (steps - 1) / 2

    def steps_done_by(self, now_s: float) -> int:
        """Whole steps completed by ``now_s`` (0..num_steps)."""
        elapsed = now_s - self.start_s
        if elapsed <= 0:
            return 0
        first, growth = self.first_step_s, self.growth_s
        if growth <= 0:
            k = int(elapsed // first)
        else:
            b = first - growth / 2
            k = int((-b + math.sqrt(b * b + 2 * growth * elapsed)) / growth)
        k = max(0, min(k, self.num_steps))
        while k < self.num_steps and self.elapsed_after(k + 1) <= elapsed:
            k += 1
        while k > 0 and self.elapsed_after(k) > elapsed:
            k -= 1
        return k


def insert_in_order(
    queue: deque[ModelRequest] | list[ModelRequest], req: ModelRequest, *, first_of_priority: bool
) -> None:
    """Put ``req`` in ``queue`` (by priority, lower first) after the requests of its priority, or
    before them. With equal priorities (the common case) it goes to an end in O(1)."""
    priority = req.spec.priority
    if first_of_priority:
        index = 0
        while index < len(queue) and queue[index].spec.priority < priority:
            index += 1
    else:
        index = len(queue)
        while index > 0 and queue[index - 1].spec.priority > priority:
            index -= 1
    queue.insert(index, req)
