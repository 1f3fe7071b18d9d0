"""The policy timer forwards every call and counts the timed ones."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.loadtest.policy_timer import PolicyTimer
from prefixmesh.replica.kvcache.policy import BlockRef, LRUPolicy


def test_it_forwards_every_call_and_times_victims_and_requests() -> None:
    timer = PolicyTimer(LRUPolicy())
    assert (timer.name, timer.victim_us, timer.request_us) == ("lru", 0.0, 0.0)
    refs = [BlockRef(BlockHash(i), None, 0) for i in (1, 2)]
    timer.on_request(refs, "")
    for ref in refs:
        timer.on_insert(0, ref)
    timer.touch(0, refs[:1])
    assert timer.admit(1, BlockHash(2), None)
    assert timer.victim(0, set()) == BlockHash(2)  # 1 was touched
    timer.on_remove(0, BlockHash(2), dropped=True)
    assert timer.victim(0, set()) == BlockHash(1)
    assert timer.promotions(set()) == ()
    assert (timer.victims, timer.requests) == (2, 1)
    assert timer.victim_us > 0 and timer.request_us > 0
