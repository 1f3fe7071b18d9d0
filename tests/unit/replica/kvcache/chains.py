"""Helpers: prompts as block chains, replayed against a bare policy (no simulator)."""

from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy import BlockRef, CachePolicy


def chain(*blocks: int) -> list[BlockRef]:
    return [
        BlockRef(BlockHash(b), BlockHash(blocks[i - 1]) if i else None, i)
        for i, b in enumerate(blocks)
    ]


def use(
    policy: CachePolicy,
    blocks: Sequence[int],
    category: str = "",
    resident: set[int] | None = None,
) -> None:
    """One request for ``blocks``, all of them then held in the engine tier (``resident``:
    the engine tier's blocks, kept up to date)."""
    refs = chain(*blocks)
    held = resident if resident is not None else set()
    policy.on_request(refs, category)
    for ref in refs:
        if ref.block not in held:
            policy.on_insert(0, ref)
            held.add(ref.block)
    policy.touch(0, refs)


def eviction_order(policy: CachePolicy, tier: int = 0) -> list[int]:
    """Every block of ``tier``, in the order the policy would evict them now."""
    order: list[BlockHash] = []
    while (victim := policy.victim(tier, set(order))) is not None:
        order.append(victim)
    return [int(b) for b in order]
