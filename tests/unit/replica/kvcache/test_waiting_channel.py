"""Notices of requests held at the replica, carried to the connector's lookahead (issue 18,
item 5): the codec, a real Unix datagram socket, and what the lookahead makes of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim
from prefixmesh.replica.kvcache.policy import Lookahead, LRUPolicy
from prefixmesh.replica.kvcache.waiting_channel import (
    MAX_BLOCKS,
    OUTSIDE_PREFIX,
    Left,
    NoticeReceiver,
    NoticeSender,
    OutsideWaits,
    Waiting,
    decode,
    encode,
)


def blocks(*ids: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(i) for i in ids)


def test_notices_round_trip_and_a_long_prompt_sends_its_head() -> None:
    for notice in (Waiting("r1", blocks(1, 2**63 - 1)), Left("r1"), Waiting("r2", ())):
        assert decode(encode(notice)) == notice
    long = Waiting("r3", blocks(*range(MAX_BLOCKS + 10)))
    assert decode(encode(long)) == Waiting("r3", long.blocks[:MAX_BLOCKS])


@pytest.mark.parametrize(
    "datagram",
    [
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"w": 3, "b": []}',
        b'{"w": "r", "b": "12"}',
        b'{"w": "r", "b": [1, "2"]}',
        b'{"w": "r", "b": [true]}',
        b'{"w": "r", "b": [1.5]}',
        b'{"l": 7}',
        b"[" * 100_000,
    ],
)
def test_anything_else_is_no_notice(datagram: bytes) -> None:
    assert decode(datagram) is None


def test_a_sender_reaches_a_receiver_in_order_and_drops_when_nobody_listens(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s")
    sender = NoticeSender(path)
    sender.waiting("early", blocks(1))  # the connector is not listening yet: dropped
    assert (sender.sent, sender.dropped) == (0, 1)
    (tmp_path / "s").write_bytes(b"")  # a regular file at the path is not replaced...
    with pytest.raises(OSError):
        NoticeReceiver(path)
    (tmp_path / "s").unlink()
    stale = NoticeReceiver(path)
    stale._socket.close()  # ...a stale socket (an engine that died) is
    receiver = NoticeReceiver(path)
    try:
        sender.waiting("a", blocks(1, 2))
        sender.left("a")
        receiver._socket.sendto(b"not json", path)
        sender.waiting("b", blocks(3))
        assert receiver.drain(limit=2) == [Waiting("a", blocks(1, 2)), Left("a")]
        assert receiver.drain() == [Waiting("b", blocks(3))]
        assert receiver.malformed == 1
        assert receiver.drain() == []
    finally:
        receiver.close()
        sender.close()
    assert not Path(path).exists()


def test_the_lookahead_keeps_what_a_held_request_needs() -> None:
    # Two blocks fit; 1 and 2 are cached, then 3 arrives. LRU evicts 1 (the least recent);
    # told that a held request needs 1, the lookahead evicts 2 instead.
    def replay(notices: list[Waiting | Left]) -> set[BlockHash]:
        looking = Lookahead(LRUPolicy(), max_queued=8)
        sim = TieredCacheSim((2,), looking)
        sim.access(CacheRequest(blocks(1)))
        sim.access(CacheRequest(blocks(2)))
        outside = OutsideWaits(looking)
        outside.hear(notices, now=0.0)
        assert outside.waits == sum(isinstance(n, Waiting) for n in notices)
        sim.access(CacheRequest(blocks(3)))
        return set(sim.blocks_in(0))

    assert replay([]) == set(blocks(2, 3))
    assert replay([Waiting("held", blocks(1))]) == set(blocks(1, 3))
    assert replay([Waiting("held", blocks(1)), Left("held")]) == set(blocks(2, 3))


def test_outside_ids_never_meet_the_engines_and_a_lost_left_expires() -> None:
    seen: list[tuple[str, str]] = []

    class Queue:
        def queued(self, request_id: str, blocks: object) -> None:
            seen.append(("queued", request_id))

        def started(self, request_id: str) -> None:
            seen.append(("started", request_id))

    outside = OutsideWaits(Queue(), ttl_s=10.0)
    outside.hear([Waiting("x", ()), Left("x"), Waiting("y", ())], now=0.0)
    assert seen == [
        ("queued", OUTSIDE_PREFIX + "x"),
        ("started", OUTSIDE_PREFIX + "x"),
        ("queued", OUTSIDE_PREFIX + "y"),
    ]
    outside.hear([Waiting("z", ())], now=5.0)
    assert outside.waiting == 2
    outside.hear([], now=10.5)  # y's Left never came: its wait ends after the TTL, z's not yet
    assert seen[-1] == ("started", OUTSIDE_PREFIX + "y") and outside.waiting == 1
    assert json.loads(encode(Left("x"))) == {"l": "x"}
