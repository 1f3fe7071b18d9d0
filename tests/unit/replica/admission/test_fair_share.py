"""Fair share at a saturated replica (issue 17, item 4): requests start at once under the
prefill budget; past it by priority, then the tenant with the least service (prompt tokens
computed, output tokens weighted), then arrival; an idle tenant banks no more than its idle
credit against the virtual time; each request takes its priority and start tag into the engine;
a request that leaves while waiting frees its place."""

from __future__ import annotations

import asyncio

import pytest

from prefixmesh.replica.admission.fair_gate import FairGate, FairStart
from prefixmesh.replica.admission.fair_share import TAG_SPAN, FairQueue, FairTicket, engine_priority


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
    # The light tenant's counter was lifted to the virtual time: h0's start tag (0), the
    # service in progress. l0 starts next; then the counters tie (100) and the shorter backlog
    # (light's: none) loses nothing, heavy's goes on in order.
    assert (queue.counter("light"), queue.counter("heavy")) == (0, 100)
    assert queue.first_token("h0") == ["l0"]
    assert queue.first_token("l0") == ["h1"]
    assert queue.first_token("h1") == ["h2"]


def test_without_idle_credit_an_idle_tenant_banks_none() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    queue.arrive(ticket("n0", "newcomer"))
    queue.first_token("n0")
    queue.ended("n0", 0)  # the newcomer served 100 tokens long ago, then went idle
    for i in range(4):
        queue.arrive(ticket(f"h{i}", "heavy"))
    assert queue.first_token("h0") == ["h1"]
    assert queue.first_token("h1") == ["h2"]
    assert queue.counter("heavy") == 300
    queue.arrive(ticket("late", "newcomer"))
    # Lifted from 100 to the virtual time: h2's start tag (200), the service in progress; it
    # goes next, and then waits behind h3 (tag 300) as a tenant that was never idle would.
    assert queue.counter("newcomer") == 200
    assert queue.first_token("h2") == ["late"]
    assert queue.engine_priority("late") == 200
    assert queue.arrive(ticket("late2", "newcomer")) == []
    assert queue.first_token("late") == ["h3"]


def test_a_tenant_back_from_idle_keeps_a_bounded_credit_for_a_burst() -> None:
    queue = FairQueue(prefill_budget_tokens=100, idle_credit_tokens=250)
    for i in range(6):
        queue.arrive(ticket(f"h{i}", "heavy"))
    assert queue.first_token("h0") == ["h1"]
    assert queue.first_token("h1") == ["h2"]
    assert queue.counter("heavy") == 300
    # Lifted to the virtual time less the credit: h2's start tag (200) - 250, so 0. Its first
    # request goes before h2 in the engine, so it starts past the budget, at once.
    assert queue.arrive(ticket("l0", "light")) == ["l0"]
    assert queue.engine_priority("l0") == 0
    for i in range(1, 5):
        assert queue.arrive(ticket(f"l{i}", "light")) == []  # not before l0: they wait
    # The burst goes ahead while its credit lasts (100 and 200 below the backlog's 300; 300
    # ties and its backlog is the shorter), l1 past the budget again (before h2), then it
    # alternates with the backlog.
    steps = [("l0", ["l1"]), ("l1", []), ("h2", ["l2"]), ("l2", ["l3"]), ("l3", ["h3"])]
    assert [(rid, queue.first_token(rid)) for rid, _ in steps] == steps
    assert queue.first_token("h3") == ["l4"]


def test_the_credit_is_bounded_below_the_virtual_time() -> None:
    queue = FairQueue(prefill_budget_tokens=100, idle_credit_tokens=150)
    for i in range(8):
        queue.arrive(ticket(f"h{i}", "heavy"))
    for rid in ["h0", "h1", "h2", "h3", "h4"]:
        queue.first_token(rid)
    assert queue.counter("heavy") == 600  # h5 prefills from tag 500
    assert queue.arrive(ticket("l0", "light")) == ["l0"]  # before h5 in the engine
    assert queue.engine_priority("l0") == 500 - 150


def test_a_tenant_that_never_goes_idle_banks_no_credit() -> None:
    queue = FairQueue(prefill_budget_tokens=100, idle_credit_tokens=250)
    queue.arrive(ticket("a0", "a"))
    queue.arrive(ticket("b0", "b"))
    queue.arrive(ticket("a1", "a"))
    assert queue.counter("b") == 0  # lifted to a0's start tag (0) less the credit: no change
    assert queue.first_token("a0") == ["b0"]
    queue.arrive(ticket("b1", "b"))  # b still has b0 here: not back from idle
    assert queue.counter("b") == 100
    assert queue.first_token("b0") == ["a1"]


def test_priority_comes_before_the_counters_and_output_is_weighted() -> None:
    queue = FairQueue(prefill_budget_tokens=10, output_weight=2.0)
    queue.arrive(ticket("a0", "a", work=10))
    assert queue.arrive(ticket("b0", "b", work=10)) == []
    # More urgent than a0: the engine serves it first, so it starts past the budget; a2 would
    # not go before a1, and waits.
    assert queue.arrive(ticket("a1", "a", work=10, priority=-1)) == ["a1"]
    assert queue.arrive(ticket("a2", "a", work=10, priority=-1)) == []
    assert queue.ended("a0", output_tokens=50) == []
    assert queue.counter("a") == 10 + 100 + 10 + 0
    # a2 is next though b is behind in service: priority first.
    assert queue.ended("a1", output_tokens=0) == ["a2"]
    assert queue.ended("a2", output_tokens=0) == ["b0"]


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


def test_a_prompt_larger_than_the_budget_starts_when_the_engine_serves_none_before_it() -> None:
    queue = FairQueue(prefill_budget_tokens=100)
    assert queue.arrive(ticket("big", "t", work=10_000)) == ["big"]
    assert queue.arrive(ticket("big2", "t", work=10_000)) == []  # behind big
    assert queue.arrive(ticket("urgent", "u", work=10_000, priority=-1)) == ["urgent"]


def test_the_engine_orders_by_priority_then_start_tag() -> None:
    queue = FairQueue(prefill_budget_tokens=1_000, idle_credit_tokens=0)
    queue.arrive(ticket("h0", "heavy", work=300))
    queue.arrive(ticket("h1", "heavy", work=300))
    queue.arrive(ticket("l0", "light", work=300))  # lifted to h0's tag (0): ahead of h1 (300)
    assert [queue.engine_priority(r) for r in ["h0", "h1", "l0"]] == [0, 300, 0]
    # 1,200 tokens would not fit in 1,000, but it goes before every tag of priority 0.
    assert queue.arrive(ticket("u0", "urgent", work=300, priority=-1)) == ["u0"]
    assert queue.engine_priority("u0") == -TAG_SPAN
    assert queue.arrive(ticket("h2", "heavy", work=300)) == []  # the budget holds for it
    queue.ended("l0", 0)
    with pytest.raises(KeyError):
        queue.engine_priority("l0")  # gone with its request


def test_the_budget_bounds_the_work_a_request_waits_behind_in_the_engine() -> None:
    queue = FairQueue(prefill_budget_tokens=300, idle_credit_tokens=1_000)
    for i in range(6):
        queue.arrive(ticket(f"h{i}", "heavy"))  # h0-h2 start (tags 0, 100, 200)
    assert queue.first_token("h0") == ["h3"]  # tag 300
    # The light burst goes before the heavy prefills in the engine: l0 waits behind nothing,
    # l1 behind l0 and h1 (its tag ties with l1's 100: the earlier first), 300 tokens with
    # its own; l2 would wait behind 400 and stays here, though the engine holds 500 then.
    assert [queue.arrive(ticket(f"l{i}", "light")) for i in range(3)] == [["l0"], ["l1"], []]
    assert queue.prefill_tokens == 500
    assert queue.first_token("h1") == []  # still l0, l1 and h2 before it
    assert queue.first_token("l0") == ["l2"]


def test_an_engine_priority_keeps_the_priority_first_and_fits_vllm_s_64_bits() -> None:
    assert engine_priority(0, 10**15) == TAG_SPAN - 1  # a tag past the span saturates
    assert engine_priority(1, 0) > engine_priority(0, TAG_SPAN * 2)
    assert engine_priority(0, -5) == 0
    assert -(2**63) <= engine_priority(-1_000_000, 0) < engine_priority(1_000_000, 2**50) < 2**63


async def test_the_gate_lets_a_waiting_request_in_when_a_slot_frees_and_cleans_up_cancels() -> None:
    gate = FairGate(FairQueue(prefill_budget_tokens=100))
    assert await gate.enter(ticket("h0", "heavy")) == FairStart(0.0, 0)
    waiting = asyncio.create_task(gate.enter(ticket("h1", "heavy")))
    cancelled = asyncio.create_task(gate.enter(ticket("h2", "heavy")))
    await asyncio.sleep(0)
    assert gate.queue.waiting == 2 and not waiting.done()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert gate.queue.waiting == 1
    gate.first_token("h0")
    start = await asyncio.wait_for(waiting, 5)
    assert start.waited_s >= 0.0 and start.engine_priority == 100  # heavy's counter after h0
    gate.leave("h0", 3)
    gate.leave("h1", 3)
    assert (gate.queue.waiting, gate.queue.prefill_tokens) == (0, 0)
