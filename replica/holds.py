"""Delay-hit holds inside a replica: wait for a prefix another request is computing here now.

The router sends a request to the replica that is prefilling its prefix, with a ``Hold``. Before
the request enters the engine, the replica checks its own table of requests in prefill: if one
of them covers the first ``hold.num_blocks`` blocks, the request waits until that one's prefill
finishes (its first token: the blocks are stored), at most ``hold.max_wait_s``; then it runs and
hits the cache instead of computing the same blocks again in the same batch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prefixmesh.cache_registry.types import BlockHash


@dataclass
class _Prefill:
    block_hashes: tuple[BlockHash, ...]
    prompt_tokens: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


def shared_blocks(a: tuple[BlockHash, ...], b: tuple[BlockHash, ...]) -> int:
    """Leading blocks two chains share. Chained hashes are equal at i only if equal before
    i, so a binary search finds the boundary in O(log n) comparisons."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


class InflightPrefills:
    def __init__(self) -> None:
        self._prefills: dict[str, _Prefill] = {}
        self.holds = 0
        self.hold_timeouts = 0

    def started(
        self, request_id: str, block_hashes: tuple[BlockHash, ...], prompt_tokens: int = 0
    ) -> None:
        self._prefills[request_id] = _Prefill(block_hashes, prompt_tokens)

    def finished(self, request_id: str) -> None:
        """The request's prefill is done (first token), or it ended without one."""
        prefill = self._prefills.pop(request_id, None)
        if prefill is not None:
            prefill.done.set()

    def covering(self, block_hashes: tuple[BlockHash, ...], num_blocks: int) -> _Prefill | None:
        """A prefill in progress whose first ``num_blocks`` blocks equal this request's (the
        chain makes equal hashes at position n-1 mean equal prefixes)."""
        if num_blocks <= 0 or num_blocks > len(block_hashes):
            return None
        target = block_hashes[num_blocks - 1]
        for prefill in self._prefills.values():
            if len(prefill.block_hashes) >= num_blocks and (
                prefill.block_hashes[num_blocks - 1] == target
            ):
                return prefill
        return None

    def longest_shared(self, block_hashes: tuple[BlockHash, ...]) -> tuple[_Prefill, int] | None:
        """The prefill in progress sharing the most leading blocks with this request."""
        best: tuple[_Prefill, int] | None = None
        for prefill in self._prefills.values():
            shared = shared_blocks(prefill.block_hashes, block_hashes)
            if shared and (best is None or shared > best[1]):
                best = (prefill, shared)
        return best

    async def wait(
        self, block_hashes: tuple[BlockHash, ...], num_blocks: int, max_wait_s: float
    ) -> bool:
        """Wait while another request computes these blocks here; True if it had to wait."""
        prefill = self.covering(block_hashes, num_blocks)
        if prefill is None:
            return False
        self.holds += 1
        try:
            await asyncio.wait_for(prefill.done.wait(), max_wait_s)
        except TimeoutError:
            self.hold_timeouts += 1
        return True

    def __len__(self) -> int:
        return len(self._prefills)
