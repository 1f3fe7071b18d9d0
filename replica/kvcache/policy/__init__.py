"""Cache policies of the hierarchical prefix cache: pure strategy objects behind one interface
(``base.CachePolicy``); ``make_policy`` builds one by name from the ``kvcache`` config.

``BeladyPolicy`` is the offline reference of the cache simulator: it needs the replay's future
(``FutureUses``), so it is neither a ``kvcache.policy`` choice nor built by ``make_policy``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from prefixmesh.config import KVCacheConfig
from prefixmesh.replica.kvcache.policy.base import (
    ENGINE_TIER,
    BlockRef,
    CachePolicy,
    Clock,
    ManualClock,
    Promotion,
)
from prefixmesh.replica.kvcache.policy.belady import NEVER, BeladyPolicy, FutureUses
from prefixmesh.replica.kvcache.policy.hotprefix import HotPrefixPolicy
from prefixmesh.replica.kvcache.policy.lookahead import DEFAULT_MAX_QUEUED, Lookahead, RequestQueue
from prefixmesh.replica.kvcache.policy.nextuse import NextUsePolicy
from prefixmesh.replica.kvcache.policy.simple import LFUPolicy, LRUPolicy
from prefixmesh.replica.kvcache.policy.workload import ReuseFit, WorkloadAwarePolicy

POLICY_NAMES: tuple[str, ...] = ("lru", "lfu", "hotprefix", "workload", "nextuse", "adaptive")


def make_policy(
    name: str,
    config: KVCacheConfig,
    *,
    clock: Clock,
    block_tokens: int,
    capacities: Sequence[int] = (),
) -> CachePolicy:
    """A fresh policy called ``name`` for one cache hierarchy, set up from ``config``.

    ``clock`` is its only source of time; ``block_tokens`` is the tokens per block (HotPrefix's
    length term); ``capacities`` the sizes of the tiers it manages, in blocks (the adaptive
    policy's shadows; without them its first candidate decides alone).
    """
    if name == "adaptive":
        # Imported here: its shadows are simulators, and the simulator imports this package.
        from prefixmesh.replica.kvcache.policy.adaptive import AdaptivePolicy

        settings = config.adaptive
        return AdaptivePolicy(
            [
                (candidate, partial(make_policy, candidate, config, clock=clock,
                                    block_tokens=block_tokens))
                for candidate in settings.candidates
            ],
            capacities,
            settings.half_life_requests,
        )  # fmt: skip
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "hotprefix":
        return HotPrefixPolicy(config.hotprefix, block_tokens=block_tokens)
    if name == "workload":
        return WorkloadAwarePolicy(config.workload, clock=clock)
    if name == "nextuse":
        return NextUsePolicy(config.nextuse, clock=clock)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """What manages a cache's lower tiers: the policy, and the queue it hears the waiting
    requests through (None: it is not told)."""

    policy: CachePolicy
    queue: RequestQueue | None = None


def make_tier_policy(
    config: KVCacheConfig,
    *,
    clock: Clock,
    block_tokens: int,
    capacities: Sequence[int] = (),
    name: str | None = None,
    lookahead_requests: int | None = None,
) -> TierPolicy:
    """The configured policy (``config.policy`` unless ``name``), wrapped in a ``Lookahead``
    over ``config.lookahead_requests`` waiting requests (unless ``lookahead_requests``) when
    that is > 0."""
    policy = make_policy(
        name or config.policy,
        config,
        clock=clock,
        block_tokens=block_tokens,
        capacities=capacities,
    )
    lookahead = config.lookahead_requests if lookahead_requests is None else lookahead_requests
    if lookahead <= 0:
        return TierPolicy(policy)
    looking = Lookahead(policy, max_queued=lookahead)
    return TierPolicy(looking, looking)


__all__ = [
    "DEFAULT_MAX_QUEUED",
    "ENGINE_TIER",
    "NEVER",
    "POLICY_NAMES",
    "BeladyPolicy",
    "BlockRef",
    "CachePolicy",
    "Clock",
    "FutureUses",
    "HotPrefixPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "Lookahead",
    "ManualClock",
    "NextUsePolicy",
    "Promotion",
    "RequestQueue",
    "ReuseFit",
    "TierPolicy",
    "WorkloadAwarePolicy",
    "make_policy",
    "make_tier_policy",
]
