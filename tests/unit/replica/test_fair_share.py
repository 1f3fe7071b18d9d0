"""Fair share at a saturated replica (issue 17, item 4): requests start at once under the
prefill budget; past it by priority, then the tenant with the least service (prompt tokens
computed, output tokens weighted), then arrival; an idle tenant banks no more than its idle
credit; a request that leaves while waiting frees its place."""

from __future__ import annotations

import asyncio

import pytest

from prefixmesh.replica.fair_gate import FairGate
from prefixmesh.replica.fair_share import FairQueue, FairTicket


def ticket(request_id: str, tenant: str, work: int = 100, priority: int = 0) -> FairTicket:
    return FairTicket(request_id, tenant, priority, work)


def test_requests_start_while_they_fit_in_the_budget_and_wait_past_it() -> None:
    queue = FairQueue(prefill_budget_tokens=250)
    assert queue.arrive(ticket("h1", "heavy")) == ["h1"]
    assert queue.arrive(ticket("h2", "heavy")) == ["h2"]
    assert queue.arrive(ticket("h3", "heavy")) == []  # 300 would not fit in 250
    assert queue.arrive(ticket("h4", "heavy")) == []
    assert (queue.waiting, queue.prefill_tokens, queue.waited) == (2, 200, 2)
    assert queue.first_token("h1") == ["h3"]
    assert queue.first_token("h2") == ["h4"]
    assert queue.ended("h1", 10) == []  # decoding requests take no budget
    assert queue.prefill_tokens == 200


def test_the_next_in_fair_order_is_not_skipped_for_a_smaller_one_that_fits() -> None:
    queue = FairQueue(prefill_budget_tokens=250)
    queue.arrive(ticket("a0", "a", work=200))
    queue.arrive(ticket("b0", "b", work=200))  # waits: 400 > 250
    queue.arrive(ticket("a1", "a", work=10))  # would fit, but b (less service) is next
    assert queue.waiting == 2
    assert queue.first_token("a0") == ["b0", "a1"]


def test_a_light_tenant_goes_ahead_of_a_heavy_tenant_s_backlog() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    assert queue.arrive(ticket("h0", "heavy")) == ["h0"]
    for i in range(1, 6):
        assert queue.arrive(ticket(f"h{i}", "heavy")) == []
    assert queue.arrive(ticket("l0", "light")) == []
    # The light tenant's counter was lifted to the heavy tenant's (100): on the tie the
    # shorter backlog goes first, so l0 starts next, then heavy's backlog in order.
    assert queue.counter("light") == queue.counter("heavy") == 100
    assert queue.first_token("h0") == ["l0"]
    assert queue.first_token("l0") == ["h1"]
    assert queue.first_token("h1") == ["h2"]


def test_without_idle_credit_an_idle_tenant_banks_none() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    queue.arrive(ticket("h0", "heavy", work=100))
    queue.arrive(ticket("h1", "heavy", work=100))
    queue.arrive(ticket("h2", "heavy", work=100))
    assert queue.counter("heavy") == 100
    queue.arrive(ticket("late", "newcomer"))
    assert queue.counter("newcomer") == 100  # lifted to the least backlogged counter
    assert queue.first_token("h0") == ["late"]
    assert (queue.counter("newcomer"), queue.counter("heavy"), queue.waiting) == (200, 100, 2)


def test_a_tenant_back_from_idle_keeps_a_bounded_credit_for_a_burst() -> None:
    queue = FairQueue(prefill_budget_tokens=100, idle_credit_tokens=250)
    for i in range(6):
        queue.arrive(ticket(f"h{i}", "heavy"))
    assert queue.first_token("h0") == ["h1"]
    assert queue.first_token("h1") == ["h2"]
    assert queue.counter("heavy") == 300
    for i in range(4):
        assert queue.arrive(ticket(f"l{i}", "light")) == []
    assert queue.counter("light") == 300 - 250  # lifted to the backlog's, less the credit
    # Its burst goes ahead while its credit lasts (three requests: 50, 150, 250 < 300), then
    # it alternates with the backlog as without credit.
    started = [queue.first_token(r)[0] for r in ["h2", "l0", "l1", "l2", "h3"]]
    assert started == ["l0", "l1", "l2", "h3", "l3"]


def test_a_tenant_that_never_goes_idle_banks_no_credit() -> None:
    queue = FairQueue(prefill_budget_tokens=100, idle_credit_tokens=250)
    queue.arrive(ticket("a0", "a"))
    queue.arrive(ticket("b0", "b"))
    queue.arrive(ticket("a1", "a"))
    assert queue.counter("b") == 0  # no lift: no other tenant was backlogged when b came
    assert queue.first_token("a0") == ["b0"]
    queue.arrive(ticket("b1", "b"))  # b still has b0 here: not back from idle
    assert queue.counter("b") == 100
    assert queue.first_token("b0") == ["a1"]


def test_priority_comes_before_the_counters_and_output_is_weighted() -> None:
    queue = FairQueue(prefill_budget_tokens=10, output_weight=2.0)
    queue.arrive(ticket("a0", "a", work=10))
    queue.arrive(ticket("b0", "b", work=10))
    queue.arrive(ticket("a1", "a", work=10, priority=-1))
    assert queue.ended("a0", output_tokens=50) == ["a1"]  # b is behind in service, a1 urgent
    assert queue.counter("a") == 10 + 100 + 10
    assert queue.ended("a1", output_tokens=0) == ["b0"]


def test_a_request_that_leaves_while_waiting_frees_its_place() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    queue.arrive(ticket("h0", "heavy"))
    queue.arrive(ticket("h1", "heavy"))
    queue.arrive(ticket("h2", "heavy"))
    assert queue.ended("h1", 0) == []
    assert queue.waiting == 1
    assert queue.first_token("h0") == ["h2"]
    assert queue.ended("unknown", 5) == []
    with pytest.raises(ValueError):
        queue.arrive(ticket("h2", "heavy"))


def test_a_prompt_larger_than_the_budget_still_starts_when_nothing_prefills() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    assert queue.arrive(ticket("big", "t", work=10_000)) == ["big"]


async def test_the_gate_lets_a_waiting_request_in_when_a_slot_frees_and_cleans_up_cancels() -> None:
    gate = FairGate(FairQueue(prefill_budget_tokens=100))
    assert await gate.enter(ticket("h0", "heavy")) == 0.0
    waiting = asyncio.create_task(gate.enter(ticket("h1", "heavy")))
    cancelled = asyncio.create_task(gate.enter(ticket("h2", "heavy")))
    await asyncio.sleep(0)
    assert gate.queue.waiting == 2 and not waiting.done()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert gate.queue.waiting == 1
    gate.first_token("h0")
    assert await asyncio.wait_for(waiting, 5) >= 0.0
    gate.leave("h0", 3)
    gate.leave("h1", 3)
    assert (gate.queue.waiting, gate.queue.prefill_tokens) == (0, 0)
