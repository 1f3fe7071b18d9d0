"""The planner's promotions ahead of need: a waiting request's disk blocks go up to the CPU tier
while the loader idles, with their slots reserved, and become the CPU tier's only once the
worker reports them read."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.replica.kvcache.plan import (
    DropJob,
    LoadCosts,
    LoadJob,
    MoveJob,
    Prefetch,
    TierChange,
)
from prefixmesh.replica.kvcache.planner import TierPlanner
from prefixmesh.replica.kvcache.policy import LRUPolicy
from tests.unit.replica.kvcache.test_planner import chain, planner, store_all, store_each

B = BlockHash


def on_disk(cpu: int, disk: int, blocks: int) -> TierPlanner:
    """A planner whose single-block prompts 1..``blocks`` went down to disk, its CPU tier
    holding the ``cpu`` ones after them (100, 101, ...)."""
    p = planner(cpu=cpu, disk=disk)
    store_each(p, *range(1, blocks + 1), *range(100, 100 + cpu))
    p.take_changes()
    return p


def test_a_waiting_requests_disk_blocks_are_promoted_once_the_worker_reports_them() -> None:
    p = on_disk(cpu=2, disk=8, blocks=3)
    # Waiting: 1, 2, 3 then 4 (held nowhere: the chain stops there); two at a time.
    assert p.prefetch("w", chain(1, 2, 3, 4), limit=2) == 2
    assert p.prefetching
    plan = p.take_plan()
    # Two CPU victims make the room; the promotion starts after the step's jobs freed it.
    assert plan.jobs == (MoveJob(B(100)), MoveJob(B(101)))
    assert plan.prefetches == (Prefetch(0, (B(1), B(2)), (False, False)),)
    # Until the report every decision sees the blocks on disk (a load would read the file).
    assert p.tier_of(B(1)) is Tier.DISK
    assert p.plan_loads([B(1)], [5]) == (LoadJob(B(1), Tier.DISK, 5),)
    p.take_plan()
    assert p.prefetch("w", chain(3), limit=2) == 0  # both slots reserved, no victim left to move
    p.take_changes()
    p.prefetched(0, failed=())
    assert not p.prefetching
    assert p.tier_of(B(1)) is Tier.CPU and p.tier_of(B(2)) is Tier.CPU
    assert p.take_plan().jobs == (DropJob(B(1), Tier.DISK), DropJob(B(2), Tier.DISK))
    assert p.size(Tier.CPU) == 2 and p.counters.prefetched == 2
    assert p.take_changes() == [
        TierChange(EventKind.REMOVED, Tier.DISK, (B(1),)),
        TierChange(EventKind.STORED, Tier.CPU, (B(1),)),
        TierChange(EventKind.REMOVED, Tier.DISK, (B(2),)),
        TierChange(EventKind.STORED, Tier.CPU, (B(2),)),
    ]
    assert p.match([B(1), B(2)], start=0, limit=2) == 2
    assert p.hides_under_compute([B(1), B(2)], compute_tokens=128)  # a memory copy now


def test_blocks_the_cpu_tier_holds_are_skipped_and_the_chain_stops_at_a_gap() -> None:
    p = on_disk(cpu=2, disk=8, blocks=3)  # 1, 2, 3 on disk; 100, 101 in the CPU tier
    assert p.prefetch("w", chain(100, 1, 5, 2), limit=8) == 1  # 5 is nowhere: 2 would be no use
    assert p.take_plan().prefetches == (Prefetch(0, (B(1),), (False,)),)


def test_a_failed_promotion_frees_its_slot_and_leaves_the_block_where_it_was() -> None:
    p = on_disk(cpu=2, disk=8, blocks=2)
    assert p.prefetch("w", chain(1, 2), limit=8) == 2
    p.take_plan()
    # 2 was not promoted (torn, or no slot free on a rank): a sound file must not be lost, and
    # a torn one is deleted by its read, so a load of it fails and is recomputed.
    p.prefetched(0, failed={B(2)})
    assert p.tier_of(B(1)) is Tier.CPU and p.tier_of(B(2)) is Tier.DISK
    assert p.take_plan().jobs == (
        DropJob(B(1), Tier.DISK),
        DropJob(B(2), Tier.CPU),  # whatever slot a rank gave it
    )
    assert p.counters.prefetched == 1 and p.counters.prefetch_failed == 1
    assert p.size(Tier.CPU) == 1  # the reservation went with it
    assert set(p.blocks_in(Tier.DISK)) == {B(2), B(100), B(101)}  # (the victims that made room)


def test_a_block_an_async_load_still_reads_from_disk_stays_there() -> None:
    p = on_disk(cpu=2, disk=8, blocks=1)
    assert p.prefetch("w", chain(1), limit=8) == 1
    p.take_plan()
    p.plan_loads([B(1)], [9], request_id="req")  # a request reads the file meanwhile
    p.take_plan()
    p.prefetched(0, failed=())
    assert p.tier_of(B(1)) is Tier.DISK
    assert p.take_plan().jobs == (DropJob(B(1), Tier.CPU),)
    assert p.counters.prefetch_failed == 1


def test_a_block_computed_again_while_it_is_promoted_is_not_stored_twice() -> None:
    p = on_disk(cpu=2, disk=8, blocks=1)
    assert p.prefetch("w", chain(1), limit=8) == 1
    p.take_plan()
    store_all(p, chain(1), first_engine_block=4)  # the engine computed it again
    assert p.take_plan().jobs == ()  # no second CPU copy: the promotion brings it
    p.prefetched(0, failed=())
    assert p.tier_of(B(1)) is Tier.CPU and p.size(Tier.CPU) == 2


def test_the_block_being_promoted_is_never_the_victim_that_makes_room_for_it() -> None:
    p = on_disk(cpu=1, disk=1, blocks=1)  # the disk holds 1 and nothing more
    assert p.prefetch("w", chain(1), limit=8) == 1
    # The CPU victim (100) has no room on disk but 1's, which must stay until its read.
    assert p.take_plan().jobs == (DropJob(B(100), Tier.CPU),)
    store_each(p, 5)  # the CPU slot is reserved and the disk's one block pinned: 5 is not kept
    assert p.tier_of(B(1)) is Tier.DISK and p.tier_of(B(5)) is None
    p.prefetched(0, failed=())
    assert p.tier_of(B(1)) is Tier.CPU and p.size(Tier.DISK) == 0


def test_shared_folder_blocks_are_promoted_into_this_replicas_cpu_tier() -> None:
    costs = LoadCosts(128, 10**6, 10_000.0, {Tier.CPU: 1e10, Tier.DISK: 1e9}, 1e9)
    p = TierPlanner(LRUPolicy(), {Tier.CPU: 4, Tier.DISK: 0}, costs, share=True)
    p.shared_view(frozenset({B(1), B(2)}))
    assert p.prefetch("w", chain(1, 2, 3), limit=8) == 2
    assert p.take_plan().prefetches == (Prefetch(0, (B(1), B(2)), (True, True)),)
    p.prefetched(0, failed=())
    assert p.take_plan().jobs == ()  # the shared folder keeps its copy
    assert p.blocks_in(Tier.CPU) == [B(1), B(2)]


def test_without_a_cpu_tier_nothing_is_promoted() -> None:
    p = planner(cpu=0, disk=4)
    store_each(p, 1)
    assert p.tier_of(B(1)) is Tier.DISK
    assert p.prefetch("w", chain(1), limit=8) == 0
    assert not p.prefetching and p.take_plan().prefetches == ()


def test_a_report_of_an_unknown_batch_changes_nothing() -> None:
    p = on_disk(cpu=2, disk=2, blocks=1)
    p.prefetched(7, failed=())
    assert p.tier_of(B(1)) is Tier.DISK and not p.take_plan()


def test_what_a_waiting_request_needs_stays_in_the_cpu_tier_until_it_leaves_the_queue() -> None:
    p = on_disk(cpu=2, disk=8, blocks=1)  # 1 on disk; 100, 101 in the CPU tier
    assert p.prefetch("w", chain(101, 1), limit=8) == 1  # 100 makes the room
    p.take_plan()
    p.prefetched(0, failed=())
    p.take_plan()
    store_each(p, 7)  # a prefill streams through: neither of w's blocks is its victim
    assert p.tier_of(B(101)) is Tier.CPU and p.tier_of(B(1)) is Tier.CPU
    assert p.tier_of(B(7)) is Tier.DISK  # straight down instead
    p.release("w")  # w's turn came: its loads pin what they read from here on
    store_each(p, 8)
    assert p.tier_of(B(8)) is Tier.CPU and p.size(Tier.CPU) == 2
    p.release("w")  # (twice, or a request that kept nothing: nothing happens)
    p.release("other")


def test_a_long_prompt_is_promoted_in_several_batches_and_keeps_them_all() -> None:
    p = on_disk(cpu=4, disk=8, blocks=3)
    assert p.prefetch("w", chain(1, 2, 3), limit=2) == 2
    assert p.prefetch("w", chain(1, 2, 3), limit=2) == 1  # the rest: 1 and 2 are on their way
    plan = p.take_plan()
    assert [f.blocks for f in plan.prefetches] == [(B(1), B(2)), (B(3),)]
    assert p.prefetching == 3
    p.prefetched(1, failed=())
    p.prefetched(0, failed=())
    assert p.prefetching == 0
    p.take_plan()
    store_each(p, 7, 8)  # each takes the one slot not w's (8 pushes 7 down, as 7 did 103)
    assert p.tier_of(B(7)) is Tier.DISK and p.tier_of(B(8)) is Tier.CPU
    assert all(p.tier_of(B(b)) is Tier.CPU for b in (1, 2, 3))
    p.release("w")
    store_each(p, 9)
    assert sum(p.tier_of(B(b)) is Tier.CPU for b in (1, 2, 3)) == 2  # one of w's went
