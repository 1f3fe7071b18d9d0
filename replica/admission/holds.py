"""Delay-hit holds inside a replica: wait for a prefix another request is computing here now.

The router sends a request to the replica that is prefilling its prefix, with a ``Hold``. Before
the request enters the engine, the replica checks its own table of requests in prefill: if one
of them covers the first ``hold.num_blocks`` blocks, the request waits until that one's prefill
finishes (its first token: the blocks are stored), at most ``hold.max_wait_s``; then it runs and
hits the cache instead of computing the same blocks again in the same batch.

A router's hold can arrive before the request it waits for (two ingresses, two handle calls:
nothing orders them), so a held request that finds no covering prefill waits a short arrival
grace for one to start. The replica also holds on its own (``own_hold``): vLLM does not
deduplicate a prefix two requests in one batch compute. ``ReplicaHolds`` is what the replica
deployment uses: the hold each request waits under, and the wait. A request and a prefill are
named by the prompt's ``PrefixKey``; only ``shared_blocks`` (``cache_registry/hashing.py``)
works on the bare hash chains. The router's side of holds is ``router/core/holds.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixmesh.cache_registry.hashing import shared_blocks
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.wire import Hold, ReplicaCapacity


@dataclass
class _Prefill:
    key: PrefixKey
    prompt_tokens: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class InflightPrefills:
    def __init__(self) -> None:
        self._prefills: dict[str, _Prefill] = {}
        self._arrival = asyncio.Event()
        """Set (then replaced) whenever a prefill starts: wakes requests in their grace."""
        self.holds = 0
        self.hold_timeouts = 0

    def started(self, request_id: str, key: PrefixKey, prompt_tokens: int = 0) -> None:
        self._prefills[request_id] = _Prefill(key, prompt_tokens)
        arrival, self._arrival = self._arrival, asyncio.Event()
        arrival.set()

    def finished(self, request_id: str) -> None:
        """The request's prefill is done (first token), or it ended without one."""
        prefill = self._prefills.pop(request_id, None)
        if prefill is not None:
            prefill.done.set()

    def covering(self, key: PrefixKey, num_blocks: int) -> _Prefill | None:
        """A prefill in progress whose first ``num_blocks`` blocks equal this request's (the
        chain makes equal hashes at position n-1 mean equal prefixes)."""
        if num_blocks <= 0 or num_blocks > len(key):
            return None
        target = key.block_hashes[num_blocks - 1]
        for prefill in self._prefills.values():
            theirs = prefill.key.block_hashes
            if len(theirs) >= num_blocks and theirs[num_blocks - 1] == target:
                return prefill
        return None

    def longest_shared(self, key: PrefixKey) -> tuple[_Prefill, int] | None:
        """The prefill in progress sharing the most leading blocks with this request."""
        best: tuple[_Prefill, int] | None = None
        for prefill in self._prefills.values():
            shared = shared_blocks(prefill.key.block_hashes, key.block_hashes)
            if shared and (best is None or shared > best[1]):
                best = (prefill, shared)
        return best

    async def wait(
        self,
        key: PrefixKey,
        num_blocks: int,
        max_wait_s: float,
        arrival_grace_s: float = 0.0,
    ) -> bool:
        """Wait while another request computes these blocks here; True if it had to wait.

        With no such request here yet, wait up to ``arrival_grace_s`` (within ``max_wait_s``)
        for one to start first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        prefill = self.covering(key, num_blocks)
        if prefill is None and arrival_grace_s > 0:
            grace_end = loop.time() + min(arrival_grace_s, max_wait_s)
            while prefill is None and (left := grace_end - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrival.wait(), left)
                prefill = self.covering(key, num_blocks)
        if prefill is None:
            return False
        self.holds += 1
        try:
            await asyncio.wait_for(prefill.done.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            self.hold_timeouts += 1
        return True

    def __len__(self) -> int:
        return len(self._prefills)


def own_hold(
    inflight: InflightPrefills,
    key: PrefixKey,
    resident_blocks: int,
    min_blocks: int,
    capacity: ReplicaCapacity | None,
) -> Hold | None:
    """Delay-hit deferral a replica applies on its own: a request that shares a long prefix
    with a prefill in progress here would compute the same blocks again in the same batch (vLLM
    does not deduplicate them); waiting for them costs about the same time and saves the work.

    Only blocks the engine does not hold yet are worth waiting for: ``resident_blocks`` of the
    request's chain are cached here already, and a prefill that shares no more than those
    (another question on a cached document) computes nothing this request needs.

    The bound is twice the prefill's idle time at the engine's ``capacity``, its attention
    included (a long prompt's takes several times its linear estimate)."""
    found = inflight.longest_shared(key)
    if found is None:
        return None
    prefill, shared = found
    if shared - resident_blocks < max(1, min_blocks):
        return None
    tokens = prefill.prompt_tokens
    rate = capacity.prefill_tokens_per_s if capacity is not None else 0.0
    prefill_s = tokens / rate if rate > 0 else float(tokens)
    if capacity is not None:
        prefill_s += capacity.prefill_attention_s(tokens, tokens)
    return Hold(shared, 2.0 * prefill_s + 0.05)


def combined_hold(router_hold: Hold | None, own: Hold | None, resident_blocks: int) -> Hold | None:
    """The router's hold and the replica's own, with the longer bound of the two (the replica
    sees its prefill directly, the router estimated it); none if the engine already holds
    every block the hold is for (the router's view lags the engine's)."""
    if router_hold is None or own is None:
        hold = router_hold or own
    else:
        hold = Hold(
            max(router_hold.num_blocks, own.num_blocks),
            max(router_hold.max_wait_s, own.max_wait_s),
        )
    if hold is None or resident_blocks >= hold.num_blocks:
        return None
    return hold


@dataclass(frozen=True, slots=True)
class HoldSettings:
    own_holds: bool
    """Whether the replica holds on its own (a router's hold is waited out either way)."""
    min_blocks: int = 1
    """Blocks beyond what the engine holds that an own hold must be for."""
    arrival_grace_s: float = 0.0
    """How long a router's hold waits for the prefill it names to start here."""

    @classmethod
    def from_config(cls, config: PrefixmeshConfig) -> HoldSettings:
        policy = config.routing.prefixmesh
        return cls(
            own_holds=policy.holds_enabled,
            min_blocks=max(1, policy.hold_min_tokens // config.cache.block_size),
            arrival_grace_s=policy.hold_arrival_grace_s,
        )


class ReplicaHolds:
    """The replica's delay-hit holds: its prefills in progress, and the hold each new request
    waits under before it enters the engine."""

    def __init__(self, settings: HoldSettings) -> None:
        self.settings = settings
        self.inflight = InflightPrefills()

    def hold_for(
        self,
        router_hold: Hold | None,
        key: PrefixKey,
        resident_blocks: Callable[[], int],
        capacity: Callable[[], ReplicaCapacity | None],
    ) -> Hold | None:
        """The hold a request (its prompt's ``key``) waits under, if any. ``resident_blocks``:
        leading blocks of its key the engine holds; ``capacity``: the engine's (both asked
        only when there is something to wait for)."""
        own_holds = self.settings.own_holds
        if router_hold is None and not (own_holds and len(self.inflight)):
            return None  # the common case: nothing to wait for, no walk over the cache
        resident = resident_blocks()
        own = None
        if own_holds:
            own = own_hold(self.inflight, key, resident, self.settings.min_blocks, capacity())
        return combined_hold(router_hold, own, resident)

    async def wait(self, hold: Hold, key: PrefixKey, from_router: bool) -> float:
        """Wait out ``hold``; the seconds it took. Only a router's hold may arrive before the
        request it waits for: it alone gets the arrival grace."""
        loop = asyncio.get_running_loop()  # the clock the hold's bounds run on
        started = loop.time()
        grace_s = self.settings.arrival_grace_s if from_router else 0.0
        await self.inflight.wait(key, hold.num_blocks, hold.max_wait_s, grace_s)
        return loop.time() - started
