"""A router's own record of which block-hash chains it sent to which replica.

Ray Serve's PrefixCacheAffinityRouter and SGLang's cache_aware policy both guess what a replica
caches from what they routed to it, in a multi-tenant prefix tree (one tenant per replica) over
characters. Here the tree is over chained block hashes: block i's hash names blocks 0..i, so a
tenant's tree is just the set of hashes it was sent, and "tenant holds the first m blocks of a
prompt" is "the prompt's hash m - 1 is in the set".

Eviction is least recently routed first and always takes a leaf, as in SGLang's tree: an insert
touches a chain from its deepest block back to its root, so every block is touched at least as
recently as any of its descendants, and the least recently touched block has no descendants
left. The sets therefore stay prefix-closed, which lets ``match`` binary-search the chain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from prefixmesh.cache_registry.types import BlockHash, ReplicaId


class RoutingHistoryTree:
    def __init__(self, max_blocks_per_tenant: int | None = None) -> None:
        """``max_blocks_per_tenant``: evict a tenant's least recently routed leaves down to this
        many blocks after each insert (None: never evict, Ray's ``do_eviction=False``)."""
        if max_blocks_per_tenant is not None and max_blocks_per_tenant < 0:
            raise ValueError(f"max_blocks_per_tenant must be >= 0, got {max_blocks_per_tenant}")
        self._max_blocks = max_blocks_per_tenant
        self._tenants: dict[ReplicaId, OrderedDict[BlockHash, None]] = {}
        """Per tenant, its blocks from least to most recently routed."""

    def insert(self, tenant: ReplicaId, chain: Sequence[BlockHash]) -> None:
        """Record that ``chain`` (a prompt's block hashes, root first) was routed to ``tenant``."""
        blocks = self._tenants.get(tenant)
        if blocks is None:
            blocks = self._tenants[tenant] = OrderedDict()
        for block in reversed(chain):  # leaf first: ancestors end up more recent
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        if self._max_blocks is not None:
            while len(blocks) > self._max_blocks:
                blocks.popitem(last=False)

    def match(self, tenant: ReplicaId, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of ``chain`` recorded for ``tenant`` (no touch: only routing does)."""
        blocks = self._tenants.get(tenant)
        if not blocks or not chain:
            return 0
        low, high = 0, len(chain)  # invariant: chain[:low] matched, chain[:high] not
        if chain[-1] in blocks:
            return high
        while low < high - 1:
            middle = (low + high) // 2
            if chain[middle - 1] in blocks:
                low = middle
            else:
                high = middle
        return low

    def match_all(
        self, tenants: Collection[ReplicaId], chain: Sequence[BlockHash]
    ) -> dict[ReplicaId, int]:
        return {tenant: self.match(tenant, chain) for tenant in tenants}

    def size(self, tenant: ReplicaId) -> int:
        """Blocks recorded for ``tenant`` (0 for one never routed to)."""
        blocks = self._tenants.get(tenant)
        return len(blocks) if blocks else 0

    def remove(self, tenant: ReplicaId) -> None:
        self._tenants.pop(tenant, None)

    def tenants(self) -> list[ReplicaId]:
        return list(self._tenants)

    def lru_order(self, tenant: ReplicaId) -> list[BlockHash]:
        """A tenant's blocks, next to be evicted first (for tests and debugging)."""
        return list(self._tenants.get(tenant, ()))
