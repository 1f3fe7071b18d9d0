from __future__ import annotations

import asyncio

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.types import EventKind, Tier
from prefixmesh.replica.admission.holds import (
    HoldSettings,
    InflightPrefills,
    ReplicaHolds,
    combined_hold,
    own_hold,
)
from prefixmesh.replica.engines.base import BlockChange, HeldMirror
from prefixmesh.wire import Hold, ReplicaCapacity
from tests.fakes import virtual_time

HASHER = BlockHasher(2, "m")
LONG = HASHER.hash_tokens(list(range(12)))  # 6 blocks
SIBLING = HASHER.hash_tokens([*range(8), 99, 98, 97, 96])  # shares 4 blocks
OTHER = HASHER.hash_tokens([5] * 12)
RATE_4 = ReplicaCapacity(4.0, 0.01, 8, 100)  # 4 tokens/s
RATE_1000 = ReplicaCapacity(1000.0, 0.01, 8, 100)


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
    from prefixmesh.cache_registry.hashing import shared_blocks

    assert shared_blocks(LONG.block_hashes, SIBLING.block_hashes) == 4
    assert shared_blocks(LONG.block_hashes, LONG.block_hashes) == 6
    assert shared_blocks(LONG.block_hashes, OTHER.block_hashes) == 0
    assert shared_blocks((), LONG.block_hashes) == 0
    inflight = InflightPrefills()
    assert inflight.longest_shared(SIBLING) is None
    inflight.started("a", LONG, 12)
    inflight.started("b", SIBLING.head(2), 4)
    found = inflight.longest_shared(SIBLING)
    assert found is not None and found[1] == 4 and found[0].prompt_tokens == 12


def test_a_replica_holds_only_for_blocks_its_engine_does_not_have() -> None:
    # Regression: a request whose document was already cached here waited for every other
    # request of the same document to reach its first token (they share the document's
    # blocks), serialising a hot group's hits behind one another.
    inflight = InflightPrefills()
    inflight.started("a", LONG, prompt_tokens=12)
    hold = own_hold(inflight, SIBLING, resident_blocks=0, min_blocks=2, capacity=RATE_4)
    assert hold == Hold(4, 2.0 * 12 / 4.0 + 0.05)
    assert own_hold(inflight, SIBLING, resident_blocks=4, min_blocks=2, capacity=RATE_4) is None
    assert own_hold(inflight, SIBLING, resident_blocks=3, min_blocks=2, capacity=RATE_4) is None
    assert own_hold(inflight, SIBLING, resident_blocks=2, min_blocks=2, capacity=RATE_4) is not None
    assert own_hold(inflight, OTHER, resident_blocks=0, min_blocks=1, capacity=RATE_4) is None


def test_a_replicas_own_hold_lasts_through_a_long_prompts_attention() -> None:
    # Regression: the bound was twice the prefill linear in its tokens, so on an engine that
    # reports an attention cost a hold ran out before a long prompt's first token.
    inflight = InflightPrefills()
    inflight.started("a", LONG, prompt_tokens=12)
    quadratic = ReplicaCapacity(4.0, 0.01, 8, 100, attn_s_per_token_pair=0.01)
    hold = own_hold(inflight, SIBLING, resident_blocks=0, min_blocks=2, capacity=quadratic)
    # 12 tokens: 3 s at the rate, plus 12 x (12 - 6 - 4) pairs at 10 ms.
    assert hold is not None and hold.max_wait_s == pytest.approx(2.0 * (3.0 + 0.24) + 0.05)


def test_the_router_hold_and_the_replica_hold_combine_to_the_longer_one() -> None:
    router = Hold(3, 0.5)
    own = Hold(4, 0.2)
    assert combined_hold(router, own, resident_blocks=0) == Hold(4, 0.5)
    assert combined_hold(router, None, resident_blocks=0) == router
    assert combined_hold(None, own, resident_blocks=0) == own
    assert combined_hold(None, None, resident_blocks=0) is None
    assert combined_hold(router, None, resident_blocks=3) is None  # the router's view lagged


def test_the_resident_mirror_counts_the_held_head_of_a_chain() -> None:
    mirror = HeldMirror()
    long = LONG.block_hashes
    mirror.apply([BlockChange(EventKind.STORED, Tier.GPU, long[:3])])
    assert mirror.leading(SIBLING.block_hashes) == 3 and mirror.leading(OTHER.block_hashes) == 0
    mirror.apply([BlockChange(EventKind.REMOVED, Tier.GPU, (long[1],))])
    assert mirror.leading(long) == 1  # a hole ends the run
    mirror.apply([BlockChange(EventKind.STORED, Tier.CPU, long)])
    assert mirror.leading(long) == 1  # only the engine tier counts
    mirror.apply([BlockChange(EventKind.CLEARED, None)])
    assert mirror.leading(long) == 0


def test_a_hold_waits_briefly_for_the_computing_request_to_arrive() -> None:
    # Two ingresses: the held sibling's call can reach the replica before the computing one's.
    async def main() -> None:
        inflight = InflightPrefills()
        waiter = asyncio.create_task(inflight.wait(SIBLING, 4, max_wait_s=5, arrival_grace_s=1.0))
        await asyncio.sleep(0.02)
        inflight.started("other", OTHER)  # another prompt starting does not end the grace
        await asyncio.sleep(0.02)
        assert not waiter.done()
        inflight.started("a", LONG)
        await asyncio.sleep(0.02)
        assert not waiter.done()  # now waiting for a's prefill itself
        inflight.finished("a")
        assert await asyncio.wait_for(waiter, 1) is True
        assert (inflight.holds, inflight.hold_timeouts) == (1, 0)

    virtual_time.run(main())


def test_the_arrival_grace_is_bounded() -> None:
    async def main() -> None:
        inflight = InflightPrefills()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await inflight.wait(SIBLING, 4, max_wait_s=5, arrival_grace_s=0.05) is False
        assert loop.time() - started == pytest.approx(0.05, abs=1e-6)
        # The grace never outlasts the hold's own bound, and the bound covers the grace.
        started = loop.time()
        assert await inflight.wait(SIBLING, 4, max_wait_s=0.02, arrival_grace_s=1.0) is False
        assert loop.time() - started == pytest.approx(0.02, abs=1e-6)
        assert (inflight.holds, inflight.hold_timeouts) == (0, 0)

    virtual_time.run(main())


def test_a_hold_ends_at_its_bound_when_the_prefill_never_finishes() -> None:
    async def main() -> None:
        inflight = InflightPrefills()
        inflight.started("a", LONG)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await inflight.wait(SIBLING, 4, max_wait_s=0.25) is True
        assert loop.time() - started == pytest.approx(0.25, abs=1e-6)
        assert (inflight.holds, inflight.hold_timeouts) == (1, 1)

    virtual_time.run(main())


def _never() -> float:
    raise AssertionError("asked although there is nothing to wait for")


def test_nothing_in_flight_and_no_router_hold_asks_nothing() -> None:
    holds = ReplicaHolds(HoldSettings(own_holds=True))
    assert holds.hold_for(None, SIBLING, _never, _never) is None


def test_the_replica_holds_on_its_own_only_when_told_it_may() -> None:
    router_hold = Hold(2, 0.5)
    for own_holds in (True, False):
        holds = ReplicaHolds(HoldSettings(own_holds=own_holds, min_blocks=1))
        holds.inflight.started("a", LONG, 12)
        hold = holds.hold_for(None, SIBLING, lambda: 0, lambda: RATE_1000)
        assert (hold is not None) is own_holds
        if hold is not None:
            assert hold.num_blocks == 4  # what the prefill in flight shares with it
        # A router's hold is waited out either way (with the longer bound when both).
        both = holds.hold_for(router_hold, SIBLING, lambda: 0, lambda: RATE_1000)
        assert both is not None and both.num_blocks == (4 if own_holds else 2)
        # Blocks the engine already holds: nothing left to wait for.
        assert holds.hold_for(router_hold, SIBLING, lambda: 4, lambda: RATE_1000) is None


def test_only_a_routers_hold_waits_for_its_prefill_to_arrive() -> None:
    async def main() -> None:
        holds = ReplicaHolds(HoldSettings(own_holds=True, arrival_grace_s=5.0))
        hold = Hold(4, 5.0)
        assert await holds.wait(hold, SIBLING, from_router=False) == 0.0  # no grace: at once
        waiter = asyncio.create_task(holds.wait(hold, SIBLING, from_router=True))
        await asyncio.sleep(0.1)  # in its grace
        holds.inflight.started("a", LONG, 12)  # the prefill it names starts here
        await asyncio.sleep(0.2)  # the grace woke, found it, and waits on it
        assert not waiter.done() and holds.inflight.holds == 1
        holds.inflight.finished("a")
        assert await asyncio.wait_for(waiter, 1) == pytest.approx(0.3, abs=1e-6)

    virtual_time.run(main())
