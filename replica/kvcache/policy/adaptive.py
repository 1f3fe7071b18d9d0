"""Adaptive (issue 18): follow whichever candidate policy would have hit most lately.

No one policy wins everywhere (docs/benchmarks-log.md, issue 18): LRU on the Mooncake trace and on
multiturn chats, HotPrefix and LFU on few-shot prompts, LFU with lower tiers. So the adaptive
policy runs the candidates side by side, as ARC adapts between recency and frequency, but
scored by simulation:

- every candidate keeps its own bookkeeping of the real tiers (each sees every insert, remove
  and touch), so any of them can decide at any time;
- every candidate also drives a shadow cache, a ``TieredCacheSim`` of the same capacities that
  holds only block hashes and replays each request: its hits are what that candidate would
  have scored had it run the cache alone;
- each request, the scores decay (half-life ``half_life_requests``) and add the shadows' hits;
  the leader, which picks victims, admits and promotes, is the best score (ties keep the
  leader, then the candidates' order).

The real cache thus behaves like the best candidate of the recent past, from the state the
real cache is in: a frequency count that restarts when its block leaves (LFU, HotPrefix) is
the real cache's, not the shadow's, so a new leader may take a while to match its shadow.
What it costs: each
eviction is the leader's own (the shadows add nothing there); each request replays the
shadows, a few microseconds per block per candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.cache_sim import CacheRequest, TieredCacheSim
from prefixmesh.replica.kvcache.policy.base import BlockRef, CachePolicy, Promotion

PolicyFactory = Callable[[], CachePolicy]


class AdaptivePolicy:
    """Candidates by name, in order of preference on a tie; ``capacities`` are the tiers this
    policy manages, first to last, in blocks (the shadows' sizes: in the simulator the engine
    tier and the lower ones; in the KV connector its CPU and disk tiers, whose first one sees
    every block a request computes, as the engine tier does)."""

    name = "adaptive"

    def __init__(
        self,
        candidates: Sequence[tuple[str, PolicyFactory]],
        capacities: Sequence[int],
        half_life_requests: float,
    ) -> None:
        if not candidates:
            raise ValueError("the adaptive policy needs at least one candidate")
        self.names = tuple(name for name, _ in candidates)
        self._live = {name: make() for name, make in candidates}
        # A shadow needs a first tier to place requests in; without one, the first candidate
        # leads for good.
        self._shadows: dict[str, TieredCacheSim] = {}
        if capacities and capacities[0] > 0:
            self._shadows = {name: TieredCacheSim(capacities, make()) for name, make in candidates}
        self._decay = 0.5 ** (1.0 / half_life_requests)
        self.scores = dict.fromkeys(self.names, 0.0)
        self.leader = self.names[0]
        self.switches = 0

    @property
    def leading(self) -> CachePolicy:
        return self._live[self.leader]

    # ---- what happens ------------------------------------------------------------------------

    def on_request(self, blocks: Sequence[BlockRef], category: str) -> None:
        if self._shadows and blocks:
            request = CacheRequest(tuple(ref.block for ref in blocks), category=category)
            decay, scores = self._decay, self.scores
            for name, shadow in self._shadows.items():
                scores[name] = scores[name] * decay + sum(shadow.access(request))
            best = self.leader
            for name in self.names:
                if scores[name] > scores[best]:
                    best = name
            if best != self.leader:
                self.leader = best
                self.switches += 1
        for policy in self._live.values():
            policy.on_request(blocks, category)

    def on_insert(self, tier: int, block: BlockRef) -> None:
        for policy in self._live.values():
            policy.on_insert(tier, block)

    def on_remove(self, tier: int, block: BlockHash, dropped: bool) -> None:
        for policy in self._live.values():
            policy.on_remove(tier, block, dropped)

    def touch(self, tier: int, blocks: Sequence[BlockRef]) -> None:
        for policy in self._live.values():
            policy.touch(tier, blocks)

    # ---- the leader decides ------------------------------------------------------------------

    def victim(self, tier: int, pinned: Container[BlockHash]) -> BlockHash | None:
        return self._live[self.leader].victim(tier, pinned)

    def admit(self, tier: int, block: BlockHash, displaced: BlockHash | None) -> bool:
        return self._live[self.leader].admit(tier, block, displaced)

    def promotions(self, pinned: Container[BlockHash]) -> Sequence[Promotion]:
        return self._live[self.leader].promotions(pinned)
