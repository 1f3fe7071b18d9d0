"""The KV connector's planner: exact loads, stores, moves and drops for hand-built cases."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash, EventKind, Tier
from prefixmesh.config import HotPrefixConfig
from prefixmesh.replica.kvcache.plan import (
    DropJob,
    LoadCosts,
    LoadJob,
    MoveJob,
    RequestLoad,
    ShareJob,
    StoreJob,
    TierChange,
)
from prefixmesh.replica.kvcache.planner import TierPlanner
from prefixmesh.replica.kvcache.policy import HotPrefixPolicy, LRUPolicy
from prefixmesh.replica.kvcache.policy.base import BlockRef

B = BlockHash
# 128-token blocks of 1 MB: recomputing one takes 12.8 ms at 10k tokens/s; reading it takes
# 0.1 ms from memory at 10 GB/s and 20 ms from a 50 MB/s disk (slower than recomputing).
FAST_DISK = LoadCosts(128, 10**6, 10_000.0, {Tier.CPU: 1e10, Tier.DISK: 1e9})
SLOW_DISK = LoadCosts(128, 10**6, 10_000.0, {Tier.CPU: 1e10, Tier.DISK: 5e7})


def chain(*blocks: int) -> list[BlockRef]:
    return [BlockRef(B(b), B(blocks[i - 1]) if i else None, i) for i, b in enumerate(blocks)]


def planner(cpu: int, disk: int, costs: LoadCosts = FAST_DISK) -> TierPlanner:
    return TierPlanner(LRUPolicy(), {Tier.CPU: cpu, Tier.DISK: disk}, costs)


def store_all(p: TierPlanner, refs: list[BlockRef], first_engine_block: int = 0) -> None:
    """One request whose blocks are all computed in one step (the connector's order)."""
    p.on_request(refs)
    for i, ref in enumerate(refs):
        p.offer(ref, first_engine_block + i)
    p.touch(refs)


def store_each(p: TierPlanner, *blocks: int) -> None:
    """Single-block requests, one step each."""
    for block in blocks:
        store_all(p, chain(block))
        p.take_plan()


def test_computed_blocks_are_written_to_the_cpu_tier_in_one_plan() -> None:
    p = planner(cpu=4, disk=0)
    store_all(p, chain(1, 2, 3), first_engine_block=10)
    plan = p.take_plan()
    assert plan.loads == ()
    assert plan.jobs == (StoreJob(B(1), 10), StoreJob(B(2), 11), StoreJob(B(3), 12))
    assert p.blocks_in(Tier.CPU) == [B(1), B(2), B(3)]
    assert p.take_changes() == [TierChange(EventKind.STORED, Tier.CPU, (B(b),)) for b in (1, 2, 3)]
    # Offered again by a later request: already there, nothing to do.
    store_all(p, chain(1, 2, 3))
    assert not p.take_plan()


def test_a_full_cpu_tier_moves_its_lru_victims_to_disk_then_drops_from_disk() -> None:
    p = planner(cpu=2, disk=1)
    store_all(p, chain(1, 2))
    p.take_plan()
    p.take_changes()
    store_all(p, chain(7))  # CPU full: the LRU victim is the older request's deeper block
    assert p.take_plan().jobs == (MoveJob(B(2)), StoreJob(B(7), 0))
    assert p.tier_of(B(2)) is Tier.DISK
    store_all(p, chain(8))  # victim 1 goes down; the disk is full, so 2 leaves it
    assert p.take_plan().jobs == (DropJob(B(2), Tier.DISK), MoveJob(B(1)), StoreJob(B(8), 0))
    assert p.blocks_in(Tier.CPU) == [B(7), B(8)]
    assert p.blocks_in(Tier.DISK) == [B(1)]
    kinds = [(c.kind, c.tier, c.blocks) for c in p.take_changes()]
    assert kinds == [
        (EventKind.REMOVED, Tier.CPU, (B(2),)),
        (EventKind.STORED, Tier.DISK, (B(2),)),
        (EventKind.STORED, Tier.CPU, (B(7),)),
        (EventKind.REMOVED, Tier.DISK, (B(2),)),
        (EventKind.REMOVED, Tier.CPU, (B(1),)),
        (EventKind.STORED, Tier.DISK, (B(1),)),
        (EventKind.STORED, Tier.CPU, (B(8),)),
    ]


def test_match_counts_the_run_after_the_engine_hit_and_stops_at_a_gap() -> None:
    p = planner(cpu=8, disk=0)
    store_all(p, chain(1, 2, 3, 5))
    p.take_plan()
    blocks = [B(1), B(2), B(3), B(4), B(5)]
    assert p.match(blocks, start=0, limit=5) == 3  # 4 is held nowhere
    assert p.match(blocks, start=1, limit=5) == 2  # the engine holds block 1 itself
    assert p.match(blocks, start=0, limit=2) == 2  # vLLM computes the prompt's last token
    assert p.match(blocks, start=3, limit=5) == 0


def test_a_disk_slower_than_recomputing_is_not_read() -> None:
    p = planner(cpu=1, disk=4, costs=SLOW_DISK)
    store_each(p, 1, 2, 3)  # 1 and 2 end on disk, 3 in CPU
    assert p.tier_of(B(3)) is Tier.CPU and p.tier_of(B(1)) is Tier.DISK
    # Two disk blocks cost 2 x 7.2 ms more than recomputing them; the CPU block saves 12.7 ms.
    assert p.match([B(1), B(2), B(3)], start=0, limit=3) == 0
    assert p.counters.loads_declined == 3
    assert p.match([B(3)], start=0, limit=1) == 1
    fast = planner(cpu=1, disk=4)
    store_each(fast, 1, 2, 3)
    assert fast.match([B(1), B(2), B(3)], start=0, limit=3) == 3


def test_the_measured_prefill_rate_decides_between_loading_and_recomputing() -> None:
    p = planner(cpu=0, disk=4)  # 1 ms a disk block against 12.8 ms to recompute it
    store_each(p, 1, 2)
    assert p.match([B(1), B(2)], start=0, limit=2) == 2
    p.measured_prefill(1_000_000.0)  # measured: a block recomputes in 0.128 ms, faster
    assert p.match([B(1), B(2)], start=0, limit=2) == 0
    assert p.costs.prefill_tokens_per_s == 1_000_000.0


def test_a_prompt_longer_than_the_cpu_tier_writes_its_tail_to_disk() -> None:
    p = planner(cpu=2, disk=4)
    store_all(p, chain(1, 2, 3))  # this step's blocks are not evicted for each other
    assert p.take_plan().jobs == (
        StoreJob(B(1), 0),
        StoreJob(B(2), 1),
        StoreJob(B(3), 2, Tier.DISK),
    )
    without_disk = planner(cpu=2, disk=0)
    store_all(without_disk, chain(1, 2, 3))
    assert len(without_disk.take_plan().jobs) == 2
    assert without_disk.counters.rejected == 1


def test_loads_are_planned_and_pinned_against_eviction_in_the_same_step() -> None:
    p = planner(cpu=2, disk=0)
    store_all(p, chain(1, 2))
    p.take_plan()
    p.plan_loads([B(1), B(2)], [40, 41])
    store_all(p, chain(9))  # every CPU block is being loaded: no victim, 9 is not written
    plan = p.take_plan()
    assert plan.loads == (LoadJob(B(1), Tier.CPU, 40), LoadJob(B(2), Tier.CPU, 41))
    assert plan.jobs == ()
    assert p.counters.rejected == 1
    store_all(p, chain(9))  # next step nothing is pinned
    assert p.take_plan().jobs[-1] == StoreJob(B(9), 0)


def test_a_step_hides_copies_under_all_of_its_compute_not_only_their_own_requests() -> None:
    p = TierPlanner(LRUPolicy(), {Tier.CPU: 4, Tier.DISK: 0}, FAST_DISK, step_tokens=3)
    store_all(p, chain(1, 2, 3, 4))
    # The step carries the running batch's decode step, 0.25 ms (copies: 0.1 ms a block).
    p.take_plan(carried_s=0.00025)
    assert p.hides_under_compute([B(1), B(2), B(3)], compute_tokens=1)  # 0.3 under 0.35 ms
    assert not p.hides_under_compute([B(4), B(1)], compute_tokens=1)  # 0.5 over 0.45: beside
    p.joins_step(2)  # another request computes 2 tokens in the step, with nothing to load
    # The step's 3 tokens are spent, so this request computes nothing more in it, but the
    # other's compute hides its copy: 0.5 under 0.55 ms.
    assert p.hides_under_compute([B(4), B(1)], compute_tokens=1)
    p.take_plan()  # nothing carried: a request's copy is back to its own compute
    assert not p.hides_under_compute([B(1), B(2)], compute_tokens=1)
    # Past the step's 3-token budget a request's tokens wait for the next step: they hide
    # nothing in this one (1 of its 10 tokens counts).
    p.take_plan(carried_tokens=2)
    assert not p.hides_under_compute([B(1), B(2), B(3), B(4)], compute_tokens=10)  # 0.4 > 0.3
    assert p.hides_under_compute([B(1), B(2)], compute_tokens=10)


def test_a_cpu_tier_load_runs_in_the_step_only_when_its_compute_hides_the_copy() -> None:
    p = planner(cpu=2, disk=1)
    store_all(p, chain(1, 2))
    p.take_plan()
    store_all(p, chain(7))  # 2 goes down to disk
    p.take_plan()
    # Copying one 1 MB block from memory at 10 GB/s takes 0.1 ms: one token (0.1 ms at 10k
    # tokens/s) hides it, none does not.
    assert not p.hides_under_compute([B(1)], compute_tokens=0)
    assert not p.hides_under_compute([B(1), B(7)], compute_tokens=1)  # 0.2 ms
    assert not p.hides_under_compute([B(1), B(2)], compute_tokens=10_000)  # a disk read
    assert not p.hides_under_compute([], compute_tokens=10)
    assert p.hides_under_compute([B(1)], compute_tokens=1)
    p.take_plan()  # a new step
    assert p.hides_under_compute([B(1), B(7)], compute_tokens=2)
    p.plan_loads([B(1)], [40], layerwise=True)
    p.plan_loads([B(2)], [41], layerwise=True)  # from disk: not a layer load
    p.plan_loads([B(7)], [42])
    assert p.counters.layer_loads == 1
    assert len(p.take_plan().loads) == 3


def test_an_async_load_keeps_its_blocks_pinned_until_the_worker_reports_it() -> None:
    p = planner(cpu=2, disk=0)
    store_all(p, chain(1, 2))
    p.take_plan()
    p.plan_loads([B(1), B(2)], [40, 41], request_id="req")
    plan = p.take_plan()
    assert plan.loads == ()
    seconds = 2 * 10**6 / 1e10
    jobs = (LoadJob(B(1), Tier.CPU, 40), LoadJob(B(2), Tier.CPU, 41))
    assert plan.async_loads == (RequestLoad("req", jobs, seconds),)
    assert p.backlog_s == seconds and p.counters.async_loads == 1
    store_all(p, chain(9))  # steps later, still loading: no victim, 9 is not written
    assert p.take_plan().jobs == () and p.tier_of(B(1)) is Tier.CPU
    p.load_finished("req")
    assert p.backlog_s == 0.0
    store_all(p, chain(8))  # now a victim can go (the deeper one first)
    assert p.take_plan().jobs == (DropJob(B(2), Tier.CPU), StoreJob(B(8), 0))


def test_a_load_that_would_wait_behind_the_queue_longer_than_a_recompute_is_not_made() -> None:
    p = planner(cpu=8, disk=0)  # a CPU block saves 12.7 ms against recomputing it
    store_all(p, chain(1, 2, 3))
    p.take_plan()
    assert p.match([B(1), B(2), B(3)], start=0, limit=3) == 3
    queued = [B(1), B(2), B(3)]
    p.plan_loads(queued, [10, 11, 12], request_id="first")
    # A queue of 0.3 ms is far less than what loading saves: load behind it.
    assert p.match([B(1), B(2), B(3)], start=0, limit=3) == 3
    p._backlog_s = 0.030  # as if 30 ms of loads were queued: two blocks save only 25.4 ms
    assert p.match([B(1), B(2)], start=0, limit=2) == 0
    assert p.match([B(1), B(2), B(3)], start=0, limit=3) == 3  # three save 38.1 ms
    p.load_finished("first")
    p.load_finished("first")  # reported twice (or never planned here): nothing happens
    assert p.backlog_s == 0.0


def test_a_disk_block_admitted_again_is_promoted_from_the_engine_copy() -> None:
    p = planner(cpu=1, disk=2)
    store_each(p, 1, 2)  # 1 moves to disk
    assert p.tier_of(B(1)) is Tier.DISK
    p.plan_loads([B(1)], [5])
    p.take_plan()
    store_all(p, chain(1), first_engine_block=5)  # loaded, then offered: goes up, 2 goes down
    assert p.take_plan().jobs == (
        MoveJob(B(2)),
        DropJob(B(1), Tier.DISK),
        StoreJob(B(1), 5),
    )
    assert p.counters.promotions == 1
    assert p.blocks_in(Tier.CPU) == [B(1)] and p.blocks_in(Tier.DISK) == [B(2)]


def test_hotprefix_admission_writes_a_block_only_once_it_is_hot() -> None:
    config = HotPrefixConfig(freq_threshold=3)
    p = TierPlanner(
        HotPrefixPolicy(config, block_tokens=128), {Tier.CPU: 4, Tier.DISK: 0}, FAST_DISK
    )
    refs = chain(1, 2)
    for _ in range(2):
        store_all(p, refs)
        assert not p.take_plan()
    assert p.counters.rejected == 4
    store_all(p, refs)  # third request: frequency 3
    assert p.take_plan().jobs == (StoreJob(B(1), 0), StoreJob(B(2), 1))


def test_restore_keeps_what_fits_and_drops_the_rest() -> None:
    p = planner(cpu=1, disk=2)
    p.restore(Tier.DISK, [B(1), B(2), B(3)])
    assert p.blocks_in(Tier.DISK) == [B(2), B(3)]  # LRU made room by dropping the oldest
    assert p.take_plan().jobs == (DropJob(B(1), Tier.DISK),)


def test_failed_loads_are_forgotten() -> None:
    p = planner(cpu=0, disk=2)
    p.restore(Tier.DISK, [B(1)])
    p.take_changes()
    p.take_plan()
    p.forget_failed([B(1)], Tier.DISK)
    assert p.tier_of(B(1)) is None
    assert p.take_changes() == [TierChange(EventKind.REMOVED, Tier.DISK, (B(1),))]
    assert p.take_plan().jobs == (DropJob(B(1), Tier.DISK),)


# ---- the cluster's shared tier ---------------------------------------------------------------

SHARED_FAST = LoadCosts(128, 10**6, 10_000.0, {Tier.CPU: 1e10, Tier.DISK: 1e9}, 1e9)
SHARED_SLOW = LoadCosts(128, 10**6, 10_000.0, {Tier.CPU: 1e10, Tier.DISK: 1e9}, 5e7)


def shared_planner(costs: LoadCosts = SHARED_FAST, cpu: int = 0) -> TierPlanner:
    return TierPlanner(LRUPolicy(), {Tier.CPU: cpu, Tier.DISK: 0}, costs, share=True)


def test_computed_blocks_go_to_the_shared_folder_once() -> None:
    p = shared_planner(cpu=4)
    store_all(p, chain(1, 2), first_engine_block=10)
    assert p.take_plan().jobs == (
        ShareJob(B(1), 10),
        StoreJob(B(1), 10),
        ShareJob(B(2), 11),
        StoreJob(B(2), 11),
    )
    store_all(p, chain(1, 2, 3), first_engine_block=20)  # queued already: only the new one
    assert p.take_plan().jobs == (ShareJob(B(3), 22), StoreJob(B(3), 22))
    assert p.counters.shares == 3


def test_a_block_another_replica_shared_is_not_written_again() -> None:
    p = shared_planner()
    p.shared_view(frozenset({B(1)}))
    store_all(p, chain(1, 2), first_engine_block=0)
    assert p.take_plan().jobs == (ShareJob(B(2), 1),)


def test_loads_come_from_the_shared_folder_when_this_replica_does_not_hold_them() -> None:
    p = shared_planner(cpu=4)
    store_all(p, chain(1), first_engine_block=0)  # this replica holds 1 in its CPU tier
    p.take_plan()
    p.shared_view(frozenset({B(1), B(2), B(3)}))  # another replica computed 2 and 3
    blocks = [B(1), B(2), B(3), B(4)]
    assert p.match(blocks, 0, 4) == 3
    jobs = p.plan_loads(blocks[:3], [7, 8, 9], request_id="req")
    assert jobs == (
        LoadJob(B(1), Tier.CPU, 7),
        LoadJob(B(2), Tier.DISK, 8, shared=True),
        LoadJob(B(3), Tier.DISK, 9, shared=True),
    )
    assert p.counters.shared_loads == 2 and p.counters.loads[Tier.CPU] == 1
    (load,) = p.take_plan().async_loads
    assert load.jobs == jobs and load.seconds == pytest.approx(0.0001 + 2 * 0.001)
    assert p.size(Tier.DISK) == 0  # the shared folder is the cluster's, not in this planner


def test_a_shared_folder_slower_than_recomputing_is_not_read() -> None:
    p = shared_planner(SHARED_SLOW)
    p.shared_view(frozenset({B(1), B(2)}))
    assert p.match([B(1), B(2), B(3)], 0, 3) == 0
    assert p.counters.loads_declined == 2


def test_without_a_shared_tier_nothing_is_shared() -> None:
    p = planner(cpu=4, disk=0)
    p.shared_view(frozenset({B(9)}))  # ignored for writes; a planner without share never gets it
    store_all(p, chain(1))
    assert not any(isinstance(job, ShareJob) for job in p.take_plan().jobs)
