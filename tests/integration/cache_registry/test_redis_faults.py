"""The Redis registry under faults: the server killed and restarted, and a server that stalls."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from prefixmesh.cache_registry.hashing import BlockHasher, FingerprintMismatchError
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.types import CacheEvent, EventKind, PrefixHit, ReplicaId, Tier
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.ports import free_port
from tests.integration.cache_registry.conftest import HASHER

pytestmark = pytest.mark.redis
R1 = ReplicaId("replica-1")
KEY = HASHER.hash_tokens(list(range(32)))
DEADLINE_S = 0.05


def stored(seq: int, epoch: int = 1) -> CacheEvent:
    return CacheEvent(EventKind.STORED, R1, seq, epoch, Tier.GPU, KEY.block_hashes)


@pytest.fixture
def server() -> Iterator[LocalRedisServer]:
    with LocalRedisServer() as private:
        yield private


@pytest.fixture
async def registry(server: LocalRedisServer) -> AsyncIterator[RedisRegistry]:
    client = RedisRegistry(
        HASHER.fingerprint,
        server.url,
        op_timeout_s=0.1,
        publish_timeout_s=0.2,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    await client.connect()
    yield client
    await client.close()


async def wait_until_available(registry: RedisRegistry, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not registry.available:
        assert time.monotonic() < deadline, "registry never left its backoff"
        await asyncio.sleep(0.02)


async def wait_until_verified(registry: RedisRegistry, timeout_s: float = 5.0) -> None:
    """After an outage the first successful call starts the fingerprint check in the
    background; results count from when it has passed."""
    deadline = time.monotonic() + timeout_s
    while not registry.verified:
        assert time.monotonic() < deadline, "registry never verified its fingerprint again"
        await wait_until_available(registry, timeout_s)
        await registry.lookup(KEY, [], deadline_s=DEADLINE_S)
        await asyncio.sleep(0.02)


async def test_killed_and_restarted_server(
    server: LocalRedisServer, registry: RedisRegistry
) -> None:
    await registry.publish([stored(0)])
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: PrefixHit(8, (8, 0, 0))}

    server.stop()
    for _ in range(5):  # nothing raises; each call returns within its budget
        started = time.monotonic()
        assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
        assert time.monotonic() - started < DEADLINE_S + 0.1
    [result] = await registry.publish([stored(1)])
    assert result.failed and result.needs_resync
    assert await registry.claim_inflight(KEY.block_hashes[0], R1, ttl_s=5) is None
    assert await registry.inflight(KEY.block_hashes[0]) is None
    assert not await registry.wait_released(KEY.block_hashes[0], timeout_s=0.05)
    await registry.touch(KEY.block_hashes[0])
    assert await registry.rate(KEY.block_hashes[0]) == 0.0
    await registry.drop_replica(R1)
    assert registry.stats.lookup_failures == 5
    assert registry.stats.publish_failures == 1

    server.start()
    await wait_until_verified(registry)
    # The restarted server lost everything: the replica's next batch is reported as a gap,
    # which is the replica's cue to publish a snapshot of what it holds.
    [after] = await registry.publish([stored(2)])
    assert after.gap and after.applied == 1
    assert registry.stats.reconnects >= 1
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {R1: PrefixHit(8, (8, 0, 0))}


async def test_fingerprint_is_rechecked_after_a_restart(
    server: LocalRedisServer, registry: RedisRegistry
) -> None:
    server.stop()
    assert await registry.lookup(KEY, [], deadline_s=DEADLINE_S) == {}
    server.start()
    intruder = RedisRegistry(BlockHasher(64, "another-model").fingerprint, server.url)
    await intruder.connect()  # first after the restart: its fingerprint is recorded
    await wait_until_available(registry)
    [result] = await registry.publish([stored(0)])  # the check starts, in the background
    assert result.failed  # not trusted before the check has passed
    for _ in range(100):  # ... which finds the mismatch and disables this client
        if not registry.available:
            break
        await asyncio.sleep(0.02)
    assert not registry.available and not registry.verified
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
    with pytest.raises(FingerprintMismatchError):
        await RedisRegistry(HASHER.fingerprint, server.url).connect()
    await intruder.close()


async def test_a_stalled_server_costs_at_most_the_deadline(
    server: LocalRedisServer, registry: RedisRegistry
) -> None:
    await registry.publish([stored(0)])
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)  # the process is alive but answers nothing
    try:
        started = time.monotonic()
        assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
        assert time.monotonic() - started < DEADLINE_S + 0.1
        assert registry.stats.lookup_failures == 1
        assert "Timeout" in registry.stats.last_error
    finally:
        os.kill(server.pid, signal.SIGCONT)
    await wait_until_verified(registry)
    hits: dict[ReplicaId, PrefixHit] = {}
    for _ in range(20):  # the connection cut by the timeout is replaced on the next call
        hits = await registry.lookup(KEY, [R1], deadline_s=0.5)
        if hits:
            break
        await asyncio.sleep(0.05)
    assert hits == {R1: PrefixHit(8, (8, 0, 0))}


async def test_the_fingerprint_recheck_stays_off_the_lookup_path(
    server: LocalRedisServer, registry: RedisRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: after an outage the first successful lookup re-checked the fingerprint
    # inline (up to op_timeout_s more), breaking the routing decision's latency bound.
    await registry.publish([stored(0)])
    server.stop()
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
    server.start()
    await wait_until_available(registry)
    check = registry._check_fingerprint

    async def slow_check() -> None:
        await asyncio.sleep(0.5)  # a registry that answers, but slowly, for this check
        await check()

    monkeypatch.setattr(registry, "_check_fingerprint", slow_check)
    started = time.monotonic()
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}  # not trusted yet
    assert time.monotonic() - started < 0.095  # an inline check would add op_timeout_s (0.1)
    assert not registry.verified


async def test_unreachable_at_connect_is_not_fatal() -> None:
    port_with_nothing = free_port()
    registry = RedisRegistry(
        HASHER.fingerprint, f"redis://127.0.0.1:{port_with_nothing}/0", op_timeout_s=0.1
    )
    await registry.connect()
    assert await registry.lookup(KEY, [], deadline_s=DEADLINE_S) == {}
    assert "Error" in registry.stats.last_error
    await registry.close()


async def test_one_missed_deadline_is_not_an_outage(
    server: LocalRedisServer, registry: RedisRegistry
) -> None:
    # Regression: a single slow lookup (a busy machine during a burst) made the client back
    # off and re-check the fingerprint, so every decision for the next 50+ ms routed blind.
    await registry.publish([stored(0)])
    assert await registry.lookup(KEY, [R1], deadline_s=0.5) == {R1: PrefixHit(8, (8, 0, 0))}
    lookup = registry._scripts["LOOKUP"]
    calls = 0

    async def slow_once(**kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.2)
        return await lookup(**kwargs)

    registry._scripts["LOOKUP"] = slow_once  # type: ignore[assignment]
    assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
    assert registry.available and registry.verified
    assert await registry.lookup(KEY, [R1], deadline_s=0.5) == {R1: PrefixHit(8, (8, 0, 0))}
    # A server that misses every deadline is an outage, caught by the third miss.
    os.kill(server.pid or 0, signal.SIGSTOP)
    try:
        for _ in range(3):
            assert await registry.lookup(KEY, [R1], deadline_s=DEADLINE_S) == {}
        assert not registry.available
    finally:
        os.kill(server.pid or 0, signal.SIGCONT)
