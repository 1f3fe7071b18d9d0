"""A request the replica holds back before the engine (a delay-hit hold, the fair-share gate)
is announced to the engine while it waits, and withdrawn before it is submitted (issue 18,
item 5: the KV connector's lookahead hears of it); one that goes straight in is not."""

from __future__ import annotations

import asyncio

from prefixmesh.replica.admission.fair_gate import FairGate
from prefixmesh.replica.admission.fair_share import FairQueue, FairTicket
from prefixmesh.replica.serving.deployment import ReplicaCore
from prefixmesh.wire import Hold
from tests.unit.replica.serving.test_spans import KEY, _drain, _Engine, _request, _server


async def _until_waiting(gate: FairGate) -> None:
    """Until the request waits at the gate (no wall-clock guess)."""
    for _ in range(1000):
        if gate.queue.waiting:
            return
        await asyncio.sleep(0)
    raise AssertionError("the request never reached the gate")


def _gated(engine: _Engine, budget: int) -> tuple[ReplicaCore, FairGate]:
    gate = FairGate(FairQueue(prefill_budget_tokens=budget))
    return _server(engine, fair=gate), gate


async def test_a_held_request_is_announced_then_withdrawn_before_it_runs() -> None:
    engine = _Engine()
    server = _server(engine)
    server.holds.inflight.started("other", KEY, 256)  # another request computes the prefix
    await _drain(server, _request(Hold(num_blocks=2, max_wait_s=0.05)))
    assert engine.notices == [("waiting", "cmpl-1"), ("left", "cmpl-1")]


async def test_a_request_that_goes_straight_in_is_not_announced() -> None:
    engine = _Engine()
    server, _ = _gated(engine, 4096)
    await _drain(server, _request())
    assert engine.notices == []


async def test_a_request_waiting_at_the_fair_gate_is_announced_once() -> None:
    engine = _Engine()
    server, gate = _gated(engine, 100)
    # Fills the budget, as urgent as the request below (so that one waits behind it).
    start = await gate.enter(FairTicket("busy", "other", -1, 100))
    assert start.waited_s == 0.0
    stream = asyncio.ensure_future(_drain(server, _request()))
    await _until_waiting(gate)
    assert engine.notices == [("waiting", "cmpl-1")]  # waiting at the gate
    gate.first_token("busy")
    await stream
    assert engine.notices == [("waiting", "cmpl-1"), ("left", "cmpl-1")]


async def test_a_request_cancelled_while_held_is_withdrawn() -> None:
    engine = _Engine()
    server, gate = _gated(engine, 100)
    await gate.enter(FairTicket("busy", "other", -1, 100))  # as urgent as the request below
    stream = asyncio.ensure_future(_drain(server, _request()))
    await _until_waiting(gate)
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    assert engine.notices == [("waiting", "cmpl-1"), ("left", "cmpl-1")]
