from __future__ import annotations

import asyncio

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.replica.holds import InflightPrefills

HASHER = BlockHasher(2, "m")
LONG = HASHER.hash_tokens(list(range(12))).block_hashes  # 6 blocks
SIBLING = HASHER.hash_tokens([*range(8), 99, 98, 97, 96]).block_hashes  # shares 4 blocks
OTHER = HASHER.hash_tokens([5] * 12).block_hashes


def test_covering_matches_on_the_shared_head_only() -> None:
    inflight = InflightPrefills()
    inflight.started("a", LONG)
    assert inflight.covering(SIBLING, 4) is not None
    assert inflight.covering(SIBLING, 5) is None
    assert inflight.covering(OTHER, 1) is None
    assert inflight.covering(SIBLING, 0) is None
    inflight.finished("a")
    assert inflight.covering(SIBLING, 4) is None and len(inflight) == 0


async def test_a_held_request_runs_when_the_prefill_finishes() -> None:
    inflight = InflightPrefills()
    inflight.started("a", LONG)
    waiter = asyncio.create_task(inflight.wait(SIBLING, 4, max_wait_s=5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    inflight.finished("a")
    assert await asyncio.wait_for(waiter, 1) is True
    assert (inflight.holds, inflight.hold_timeouts) == (1, 0)


async def test_a_hold_is_bounded_and_nothing_to_wait_for_returns_at_once() -> None:
    inflight = InflightPrefills()
    assert await inflight.wait(SIBLING, 4, max_wait_s=5) is False
    inflight.started("a", LONG)
    assert await inflight.wait(SIBLING, 4, max_wait_s=0.05) is True
    assert inflight.hold_timeouts == 1


def test_shared_blocks_and_the_longest_prefill() -> None:
    from prefixmesh.replica.holds import shared_blocks

    assert shared_blocks(LONG, SIBLING) == 4
    assert shared_blocks(LONG, LONG) == 6
    assert shared_blocks(LONG, OTHER) == 0
    assert shared_blocks((), LONG) == 0
    inflight = InflightPrefills()
    assert inflight.longest_shared(SIBLING) is None
    inflight.started("a", LONG, 12)
    inflight.started("b", SIBLING[:2], 4)
    found = inflight.longest_shared(SIBLING)
    assert found is not None and found[1] == 4 and found[0].prompt_tokens == 12
