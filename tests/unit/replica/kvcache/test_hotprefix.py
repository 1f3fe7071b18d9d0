"""HotPrefix: hotness records, Eq. 5 eviction, two-stage admission, promotion plans."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import HotPrefixConfig
from prefixmesh.replica.kvcache.policy import HotPrefixPolicy, Promotion

from .chains import chain, eviction_order, use


def hotprefix(block_tokens: int = 1, **overrides: object) -> HotPrefixPolicy:
    settings: dict[str, object] = {"max_age": 4, "aging_interval_requests": 1}
    settings.update(overrides)
    return HotPrefixPolicy(HotPrefixConfig(**settings), block_tokens=block_tokens)


def test_paper_defaults() -> None:
    config = HotPrefixConfig()
    assert (config.max_age, config.freq_threshold, config.max_frequency) == (255, 10, 255)
    assert config.eviction_priority == "frequency + clock / length"
    assert config.admission_hotness == "frequency * clock"
    assert config.length_unit == "tokens"


def test_frequency_accumulates_and_the_clock_ages_per_period() -> None:
    policy = hotprefix(aging_interval_requests=2, max_age=3)
    use(policy, [1])  # request 1, tick 0
    assert (policy.frequency(BlockHash(1)), policy.clock(BlockHash(1))) == (1, 3)
    use(policy, [2])  # request 2, tick 1
    assert policy.clock(BlockHash(1)) == 2
    use(policy, [2])
    use(policy, [2])  # request 4, tick 2
    assert (policy.frequency(BlockHash(2)), policy.clock(BlockHash(2))) == (3, 3)
    assert policy.clock(BlockHash(1)) == 1
    for _ in range(6):
        use(policy, [2])
    assert policy.clock(BlockHash(1)) == 0  # floor
    assert policy.frequency(BlockHash(2)) == 9


def test_frequency_saturates() -> None:
    policy = hotprefix(max_frequency=3)
    for _ in range(5):
        use(policy, [1])
    assert policy.frequency(BlockHash(1)) == 3


def test_eviction_is_frequency_plus_clock_over_length() -> None:
    policy = hotprefix()  # max_age 4, one period per request, length 1 block
    held: set[int] = set()
    use(policy, [1, 2], resident=held)  # tick 1
    use(policy, [3], resident=held)  # tick 2
    use(policy, [1], resident=held)  # tick 3: 1 has frequency 2
    # priorities: 1 = 2 + 4, 2 = 1 + (4 - 2), 3 = 1 + (4 - 1)
    assert [policy.priority(BlockHash(b)) for b in (1, 2, 3)] == [6, 3, 4]
    assert eviction_order(policy) == [2, 3, 1]


def test_long_blocks_make_the_clock_a_tie_break() -> None:
    policy = hotprefix(block_tokens=512)  # length in tokens (paper): clock / 512 < 1
    held: set[int] = set()
    use(policy, [1], resident=held)
    use(policy, [1], resident=held)
    use(policy, [2], resident=held)
    use(policy, [3], resident=held)
    assert eviction_order(policy) == [2, 3, 1]  # frequency first, then the older clock


def test_a_prompt_leaves_tail_first_so_only_leaves_are_evicted() -> None:
    policy = hotprefix()
    held: set[int] = set()
    use(policy, [1, 2, 3], resident=held)
    use(policy, [1, 2, 3], resident=held)
    use(policy, [1, 4], resident=held)  # 1 is shared and hotter than its children
    assert eviction_order(policy) == [4, 3, 2, 1]


def test_admission_needs_the_threshold_and_more_heat_than_the_displaced_block() -> None:
    policy = hotprefix(freq_threshold=2, max_age=10)
    use(policy, [1])
    assert not policy.admit(1, BlockHash(1), displaced=None)  # seen once
    use(policy, [1])
    use(policy, [2])
    use(policy, [2])
    use(policy, [2])
    assert policy.admit(1, BlockHash(1), displaced=None)  # room below: threshold only
    # hotness = frequency * clock: 1 -> 2 * 7 = 14, 2 -> 3 * 10 = 30
    assert (policy.hotness(BlockHash(1)), policy.hotness(BlockHash(2))) == (14, 30)
    assert not policy.admit(1, BlockHash(1), displaced=BlockHash(2))
    assert policy.admit(1, BlockHash(2), displaced=BlockHash(1))
    everything = hotprefix(freq_threshold=2, admission=False)
    use(everything, [1])
    assert everything.admit(1, BlockHash(1), displaced=None)


def _with_hot_block_below(**overrides: object) -> HotPrefixPolicy:
    """Engine tier: 1 (hot), 5 (cold); block 2 (hot, child of 1) in the lower tier."""
    settings: dict[str, object] = {"max_age": 10, "promotion": True}
    settings.update(overrides)
    policy = hotprefix(**settings)
    held: set[int] = set()
    for _ in range(4):
        use(policy, [1, 2], resident=held)  # ticks 1-4: 1 and 2 have frequency 4
    policy.on_remove(0, BlockHash(2), dropped=False)
    policy.on_insert(1, chain(1, 2)[1])
    held.discard(2)
    use(policy, [5], resident=held)  # tick 5
    return policy


def test_promotion_swaps_a_hot_lower_root_for_a_colder_engine_leaf() -> None:
    policy = _with_hot_block_below()
    # 2: 4 * 9 = 36 beats 5: 1 * 10 = 10; 1 is 2's parent and hotter anyway
    assert policy.promotions(set()) == [Promotion(BlockHash(2), 1, (BlockHash(5),))]
    assert policy.promotions({BlockHash(5)}) == []  # 1 is the only other leaf: the parent
    demote = _with_hot_block_below(promotion_victims="demote")
    assert demote.promotions(set())[0].drop_victims is False
    assert _with_hot_block_below(promotion=False).promotions(set()) == ()


def test_promotion_waits_for_its_interval_and_needs_a_colder_victim() -> None:
    policy = _with_hot_block_below(promotion_interval_requests=2)  # 5 requests so far
    assert policy.promotions(set()) == ()
    cold_below = hotprefix(max_age=10, promotion=True)
    held: set[int] = set()
    use(cold_below, [1, 2], resident=held)
    cold_below.on_remove(0, BlockHash(2), dropped=False)
    cold_below.on_insert(1, chain(1, 2)[1])
    held.discard(2)
    for _ in range(3):
        use(cold_below, [5], resident=held)
    assert cold_below.promotions(set()) == []  # 2 (1 * 7) is colder than 5 (3 * 10)


def test_eviction_formula_is_configurable_but_must_grow_with_the_clock() -> None:
    policy = hotprefix(eviction_priority="frequency * clock")
    held: set[int] = set()
    use(policy, [1], resident=held)
    use(policy, [1], resident=held)
    use(policy, [2], resident=held)
    # 1: 2 * 3 = 6, 2: 1 * 4 = 4
    assert eviction_order(policy) == [2, 1]
    with pytest.raises(ValueError, match="must not fall"):
        hotprefix(eviction_priority="frequency - clock")
    with pytest.raises(ValueError, match="cannot read"):
        hotprefix(eviction_priority="frequency + depth")


def test_records_of_blocks_no_tier_holds_are_pruned_coldest_first() -> None:
    policy = hotprefix(max_tracked_blocks=4, max_age=100)
    held: set[int] = set()
    use(policy, [1], resident=held)
    use(policy, [1], resident=held)
    for block in (2, 3, 4):
        use(policy, [block])
        policy.on_remove(0, BlockHash(block), dropped=True)
    use(policy, [5])  # 5 records > 4: keep 3, never the held block 1
    assert policy.frequency(BlockHash(1)) == 2
    assert [policy.frequency(BlockHash(b)) for b in (2, 3, 4, 5)] == [0, 0, 1, 1]


def test_the_eviction_stream_is_the_eviction_order() -> None:
    policy = hotprefix(max_age=6)
    held: set[int] = set()
    for blocks in ([1, 2, 3], [1, 2], [4], [5, 6], [1], [5]):
        use(policy, blocks, resident=held)
    order = eviction_order(policy)
    # at tick 6: 3 = 1 + 1, 4 = 1 + 3, 2 = 2 + 2, 6 = 1 + 4, 5 = 2 + 6, 1 = 3 + 5
    # (equal priorities: the lower frequency first)
    assert order == [3, 4, 2, 6, 5, 1]
    assert [int(b) for b in policy.eviction_stream(0, set())] == order
    assert [int(b) for b in policy.eviction_stream(0, {BlockHash(4)})] == [3, 2, 6, 5, 1]
