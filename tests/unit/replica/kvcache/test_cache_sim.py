"""The multi-tier cache simulator: hits per tier, loads, demotion through admission, orphans,
promotions; exact blocks in each tier."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import HotPrefixConfig
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim
from prefixmesh.replica.kvcache.policy import HotPrefixPolicy, LRUPolicy, ManualClock


def req(*blocks: int, output: tuple[int, ...] = ()) -> CacheRequest:
    return CacheRequest(
        tuple(BlockHash(b) for b in blocks), output_blocks=tuple(BlockHash(b) for b in output)
    )


def tiers(sim: TieredCacheSim) -> list[list[int]]:
    return [sorted(sim.blocks_in(t)) for t in range(len(sim.capacities))]


def test_engine_evictions_go_down_and_lower_hits_come_back_up() -> None:
    sim = TieredCacheSim((3, 2), LRUPolicy())
    assert sim.access(req(1, 2, 3)) == (0, 0)
    assert sim.access(req(4, 5)) == (0, 0)  # evicts 3 then 2 (LRU, tail first) to the CPU tier
    assert tiers(sim) == [[1, 4, 5], [2, 3]]
    assert sim.access(req(1, 2, 3, 6)) == (1, 2)  # 1 in the engine tier, 2 and 3 below
    assert tiers(sim) == [[1, 2, 3], [4, 5]]  # 6 did not fit: 4 requests' own blocks pinned
    result = sim.result()
    assert result.hits_by_tier == (1, 2)
    assert (result.blocks, result.hit_rate) == (9, pytest.approx(3 / 9))
    assert result.blocks_written == 4  # 3, 2, then 5 and 4
    assert (result.blocks_loaded, result.blocks_promoted, result.blocks_evicted) == (2, 2, 4)


def test_the_last_tier_drops_and_the_blocks_under_a_dropped_block_go_with_it() -> None:
    sim = TieredCacheSim((2, 1), LRUPolicy())
    sim.access(req(1, 2))
    sim.access(req(3, 4))  # 2 goes down, then 1 goes down and pushes 2 out of the CPU tier
    assert tiers(sim) == [[3, 4], [1]]
    sim.access(req(5))  # 4 goes down over 1
    assert tiers(sim) == [[3, 5], [4]]
    result = sim.result()
    assert (result.blocks_written, result.blocks_dropped_orphans) == (3, 0)
    # A block dropped from the CPU tier while its child is still below it takes the child.
    sim = TieredCacheSim((1, 2), LRUPolicy())
    sim.access(req(1, 2))  # request longer than the engine tier: 1 kept, 2 not stored
    assert tiers(sim) == [[1], []]
    sim.access(req(7))
    sim.access(req(8))
    sim.access(req(9))  # 1 and 7 went down, then 8: 1 leaves the CPU tier
    assert tiers(sim) == [[9], [7, 8]]


class _RejectOne(LRUPolicy):
    def __init__(self, rejected: int) -> None:
        super().__init__()
        self.rejected = BlockHash(rejected)

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return block != self.rejected


def test_blocks_under_a_dropped_block_are_dropped_with_it() -> None:
    sim = TieredCacheSim((2, 2), _RejectOne(1))
    sim.access(req(1, 2))
    sim.access(req(3))  # 2 goes down, below 1
    assert tiers(sim) == [[1, 3], [2]]
    sim.access(req(4))  # 1 is not admitted: dropped, and 2 is unreachable without it
    assert tiers(sim) == [[3, 4], []]
    result = sim.result()
    assert (result.blocks_rejected, result.blocks_dropped_orphans) == (1, 1)
    assert sim.access(req(1, 2)) == (0, 0)


def test_admission_rejects_cold_blocks_and_counts_them() -> None:
    config = HotPrefixConfig(freq_threshold=2, promotion=False, length_unit="blocks")
    sim = TieredCacheSim((2, 4), HotPrefixPolicy(config, block_tokens=16))
    sim.access(req(1, 2))
    sim.access(req(1, 2))  # 1 and 2 seen twice
    sim.access(req(3, 4))  # evicts 2, 1 (frequency 2: admitted)
    sim.access(req(5, 6))  # evicts 4, 3 (frequency 1: dropped)
    assert tiers(sim) == [[5, 6], [1, 2]]
    result = sim.result()
    assert (result.blocks_written, result.blocks_rejected, result.blocks_evicted) == (2, 2, 4)


def test_answer_blocks_are_stored_but_not_counted() -> None:
    sim = TieredCacheSim((8,), LRUPolicy())
    sim.access(req(1, 2, output=(3,)))
    assert sim.access(req(1, 2, 3, 4)) == (3,)
    assert sim.result().blocks == 6


def test_promotion_moves_a_hot_block_up_and_drops_or_demotes_its_victim() -> None:
    def run(victims: str) -> TieredCacheSim:
        config = HotPrefixConfig(
            max_age=10, aging_interval_requests=1, length_unit="blocks", freq_threshold=1,
            promotion=True, promotion_victims=victims,
        )  # fmt: skip
        clock = ManualClock()
        sim = TieredCacheSim((2, 2), HotPrefixPolicy(config, block_tokens=16), clock)
        for _ in range(3):
            sim.access(req(1, 2, 3))  # only 1 and 2 fit the engine tier
        assert tiers(sim) == [[1, 2], []]
        sim.access(req(9))  # 2 down; 9 is a cold engine leaf; 2 (hot) is a root below 1
        return sim

    dropped = run("drop")
    assert tiers(dropped) == [[1, 2], []]
    assert dropped.result().blocks_promoted_ahead == 1
    demoted = run("demote")
    assert tiers(demoted) == [[1, 2], [9]]
    assert demoted.result().blocks_written == 2


def test_capacities_are_checked() -> None:
    with pytest.raises(ValueError):
        TieredCacheSim((0, 4), LRUPolicy())
    with pytest.raises(ValueError):
        TieredCacheSim((4, -1), LRUPolicy())
