"""The in-process registry client does its work when called, under the lock it shares with the
process's other users of the state, and hands back a finished future; ``settled`` awaits only
what is not done yet."""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.memory import InMemoryRegistry, RegistryState
from prefixmesh.cache_registry.protocol import CacheRegistry, settled
from prefixmesh.cache_registry.types import BlockHash, ReplicaId

HASHER = BlockHasher(2, "m")
KEY = HASHER.hash_tokens(list(range(8)))
R1 = ReplicaId("r1")


class CountingLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.entered += 1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()


async def test_calls_are_done_when_made_and_take_the_shared_lock() -> None:
    lock = CountingLock()
    state = RegistryState()
    registry = InMemoryRegistry(HASHER.fingerprint, state, lock)
    assert isinstance(registry, CacheRegistry)
    write = registry.add_speculative(KEY, R1, 5.0)
    assert write.done() and lock.entered == 1
    assert state.lookup(KEY, [R1])[R1].num_blocks == 4  # before anything was awaited
    lookup = registry.lookup(KEY, [R1], deadline_s=0.001)
    assert lookup.done() and lookup.result()[R1].num_speculative == 4
    claim = registry.claim_inflight(BlockHash(KEY.block_hashes[0]), R1, 5.0)
    assert claim.result() == R1 and lock.entered == 3
    released = registry.release_inflight(BlockHash(KEY.block_hashes[0]), R1)
    assert released.result() is True and lock.entered == 4


async def test_a_failing_call_is_a_failed_future_not_a_raise() -> None:
    registry = InMemoryRegistry(HASHER.fingerprint)

    def broken() -> None:
        raise RuntimeError("bug")

    future = registry._now(broken)
    assert future.done() and isinstance(future.exception(), RuntimeError)


async def test_settled_waits_only_for_what_is_not_done() -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(1)
    assert await settled(done, 0.0)  # no yield, no timeout: it is done
    pending = loop.create_future()
    assert not await settled(pending, 0.01)
    assert not pending.cancelled()  # left to land later
    loop.call_soon(pending.set_result, 2)
    assert await settled(pending, 1.0) and pending.result() == 2
    failing = loop.create_future()
    loop.call_soon(failing.set_exception, ConnectionError("down"))
    assert await settled(failing, 1.0) and isinstance(failing.exception(), ConnectionError)
