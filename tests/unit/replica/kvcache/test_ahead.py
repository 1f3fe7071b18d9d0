"""The scheduler side's promotions ahead of need: oldest waiting requests first, in batches, up
to the bound on their way, never while a load is queued, done once every rank reported."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.replica.kvcache.ahead import PREFETCH_BATCH, AheadOfNeed, WaitingPrompt
from prefixmesh.replica.kvcache.worker_report import PrefetchReport
from tests.unit.replica.kvcache.test_planner import planner, store_each

B = BlockHash


def on_disk(blocks: int, cpu: int) -> object:
    p = planner(cpu=cpu, disk=1000)
    store_each(p, *range(1, blocks + 1))  # all but the last ``cpu`` went down to disk
    store_each(p, *range(5000, 5000 + cpu))
    return p


def prompt(request_id: str, first: int, count: int) -> WaitingPrompt:
    return WaitingPrompt(request_id, [B(b) for b in range(first, first + count)], count)


def test_oldest_first_in_batches_up_to_the_bound() -> None:
    p = on_disk(blocks=200, cpu=200)
    ahead = AheadOfNeed(p, bound=150, ranks=1)
    ahead.waiting(prompt("old", 1, 100))
    ahead.waiting(prompt("new", 101, 100))
    ahead.plan()
    batches = [f.blocks for f in p.take_plan().prefetches]
    assert [len(b) for b in batches] == [PREFETCH_BATCH, 100 - PREFETCH_BATCH, 50]
    assert batches[0][0] == B(1) and batches[2][0] == B(101)
    ahead.plan()  # the bound is reached: nothing more until reports come
    assert p.take_plan().prefetches == ()
    ahead.reported(PrefetchReport.of_rank({0: [], 1: []}))
    assert p.prefetching == 50
    ahead.plan()
    assert [f.blocks[0] for f in p.take_plan().prefetches] == [B(151)]


def test_nothing_is_promoted_while_a_load_is_queued_or_with_a_bound_of_zero() -> None:
    p = on_disk(blocks=10, cpu=10)
    p.plan_loads([B(1)], [3], request_id="loading")  # a request's load waits on the loader
    ahead = AheadOfNeed(p, bound=64, ranks=1)
    ahead.waiting(prompt("w", 2, 5))
    ahead.plan()
    assert p.take_plan().prefetches == ()
    p.load_finished("loading")
    AheadOfNeed(p, bound=0, ranks=1).plan()
    assert p.take_plan().prefetches == ()
    ahead.plan()
    assert [f.blocks for f in p.take_plan().prefetches] == [tuple(B(b) for b in range(2, 7))]


def test_a_request_that_left_is_not_promoted_and_what_it_kept_is_released() -> None:
    p = on_disk(blocks=4, cpu=4)
    ahead = AheadOfNeed(p, bound=64, ranks=2)
    ahead.waiting(prompt("w", 1, 2))
    ahead.waiting(prompt("gone", 3, 2))
    ahead.left("gone")
    ahead.plan()
    assert [f.blocks for f in p.take_plan().prefetches] == [(B(1), B(2))]
    ahead.reported(PrefetchReport.of_rank({0: []}))  # one rank of two: not done yet
    assert p.prefetching == 2 and p.tier_of(B(1)) is Tier.DISK
    ahead.reported(PrefetchReport.of_rank({0: []}))
    assert p.tier_of(B(1)) is Tier.CPU
    ahead.left("w")
    store_each(p, 7, 8, 9, 10)  # nothing kept any more: w's blocks may go
    assert p.tier_of(B(1)) is not Tier.CPU
