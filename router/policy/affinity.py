"""Affinity groups: how many replicas a prefix group gets, from its measured traffic.

A group's traffic arrives as ``view.group_rate``: the decayed sum of ``traffic_weight`` over its
requests, per second. The weight is a request's work in busy-seconds of an average replica
(prefill + decode share), so the rate reads directly as "replicas kept busy by this group", and

    k = ceil(rate / affinity_target_utilization)

replicas keep each member near the target. Sizing uses total work, not prefill alone: a hot
group whose cost is mostly decode would otherwise be squeezed onto too few replicas.

Hysteresis: k grows as soon as the traffic needs it, but shrinks only once k - 1 (or fewer)
would still cover the traffic with ``affinity_hysteresis`` headroom. A rate hovering at a
boundary therefore keeps one k; since the members for k are a prefix of the members for k + 1
on the ring, a change of k moves one replica in or out, never reshuffles the group.

Only hot groups (k >= 2) are remembered, least recently seen forgotten first beyond
``affinity_max_groups``; a forgotten group restarts from its measured rate.

Warm-up: the registry's decayed counter of a group that started t seconds ago reads only
1 - 2**(-t / half_life) of its steady rate (a blog-like hot prompt at 30 s half-life is sized at
half its traffic after 30 s, and squeezed onto too few replicas meanwhile). ``observed`` divides
that bias out, using when this router first saw the group, capped at ``max_warmup_boost``. A
router that joins late over-sizes a known group for a half-life or two, which costs a copy.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from prefixmesh.cache_registry.types import BlockHash

_MAX_NEEDED = 1e9
"""Caps an absurd (or infinite) rate: k is clipped to the fleet size anyway."""


class AffinityGroups:
    def __init__(
        self,
        *,
        target_utilization: float,
        hysteresis: float,
        max_groups: int,
        rate_half_life_s: float = 30.0,
        max_warmup_boost: float = 1.0,
        min_requests: int = 1,
    ) -> None:
        if not 0 < target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization}")
        if not rate_half_life_s > 0 or not max_warmup_boost >= 1:
            raise ValueError("rate_half_life_s must be > 0 and max_warmup_boost >= 1")
        self._target = target_utilization
        self._hysteresis = hysteresis
        self._max_groups = max_groups
        self._half_life_s = rate_half_life_s
        self._max_boost = max_warmup_boost
        self._min_requests = min_requests
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()
        self._first_seen: OrderedDict[BlockHash, list[float]] = OrderedDict()
        """Per group: [when this router first saw it, requests it has seen since]."""

    def observed(self, group: BlockHash, rate: float, now_s: float) -> float:
        """The group's registry rate with the decayed counter's warm-up bias divided out; 0
        until this router has seen ``min_requests`` of its requests (a rate read off a handful
        of requests, boosted for their youth, would buy copies on noise)."""
        first_seen = self._first_seen
        seen = first_seen.get(group)
        if seen is None:
            seen = first_seen[group] = [now_s, 0.0]
            if len(first_seen) > self._max_groups:
                first_seen.popitem(last=False)
        else:
            first_seen.move_to_end(group)
        seen[1] += 1
        if seen[1] < self._min_requests:
            return 0.0
        if self._max_boost <= 1.0 or not rate > 0:
            return rate
        filled = -math.expm1(-(now_s - seen[0]) / self._half_life_s * math.log(2))
        return rate / filled if filled * self._max_boost > 1.0 else rate * self._max_boost

    def needed(self, rate: float) -> float:
        """Replicas' worth of capacity a group with this traffic needs at the target."""
        if not rate > 0:  # also NaN
            return 0.0
        return min(rate / self._target, _MAX_NEEDED)

    def size(self, group: BlockHash, rate: float) -> int:
        """The group's replica count now (>= 1; the caller clips it to the fleet)."""
        needed = self.needed(rate)
        current = self._sizes.get(group, 1)
        wanted = max(1, _ceil(needed))
        if wanted < current:
            relaxed = max(1, _ceil(needed * (1 + self._hysteresis)))
            wanted = relaxed if relaxed < current else current
        if wanted >= 2:
            self._sizes[group] = wanted
            self._sizes.move_to_end(group)
            if len(self._sizes) > self._max_groups:
                self._sizes.popitem(last=False)
        elif group in self._sizes:
            del self._sizes[group]
        return wanted

    def known(self) -> dict[BlockHash, int]:
        """The hot groups remembered now, with their k."""
        return dict(self._sizes)


def _ceil(value: float) -> int:
    """ceil that forgives float noise: 2.0000000001 replicas' worth needs 2, not 3."""
    return math.ceil(value - 1e-9)
