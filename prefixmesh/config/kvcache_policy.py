"""``kvcache.hotprefix``, ``kvcache.workload``, ``kvcache.nextuse``, ``kvcache.adaptive``: the
settings of each cache policy (``replica/kvcache/policy/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section


class HotPrefixConfig(Section):
    """HotPrefix (seed-000): hotness per block (frequency and an aging clock), eviction by
    frequency + clock / length, selective admission to the lower tier, periodic promotion."""

    max_age: int = Field(default=255, ge=1)
    """The clock a block gets on every access; aging takes one off per period, floor 0
    (paper: 255, an 8-bit field)."""
    aging_interval_requests: int = Field(default=16, ge=1)
    """Requests per aging period ("a fixed number of user requests"; the paper gives none).
    Measured (cache-sim, lower tier = engine tier, write-all, no promotion): fewshot at 5%
    hit 80.6 / 81.9 / 82.8 / 83.1% at 1 / 4 / 16 / 64; Mooncake with token lengths the same
    at every value (clock / 512 < 0.5). 16: within 0.3 points of 64 with a 16x shorter memory
    (a block is fully cold after 255 * 16 requests)."""
    max_frequency: int = Field(default=255, ge=1)
    """Frequency saturates here (paper: an 8-bit field)."""
    length_unit: Literal["tokens", "blocks"] = "tokens"
    """The ``length`` of the formulas: a block's tokens (paper: a radix node's tokens) or 1
    per block."""
    eviction_priority: str = "frequency + clock / length"
    """Eq. 5, lowest evicted first; any expression over frequency, clock, length with
    ``+ - * /`` (the paper makes it configurable) that does not fall as clock grows."""
    admission_hotness: str = "frequency * clock"
    """Eq. 6, compared at admission and promotion; configurable like the eviction priority."""
    admission: bool = True
    """Admit a block evicted from a tier to the next one only when it is hot enough; False
    writes every evicted block (the paper's ablation baseline)."""
    freq_threshold: int = Field(default=10, ge=0)
    """Admission stage 1: an evicted block seen fewer times than this is dropped (paper: 10).
    Measured (lower tier = engine tier): fewshot at 5% 10 writes 5.1x fewer blocks than
    writing all at -6.0% hit rate, 2 writes 2.6x fewer at -0.2%; on Mooncake 10 admits
    nothing (its blocks rarely reach 10 uses before they are evicted) and 2 writes 2.3x fewer
    at -2.5%: tune it per workload."""
    promotion: bool = False
    """Periodically move the hottest lower-tier blocks whose parent is in the engine tier up,
    in place of colder engine-tier blocks (paper §3.4). Off by default: here a lower-tier hit
    is loaded when used anyway, and dropping the victims (and the blocks below them) costs
    hits. Measured (lower tier = engine tier, 5%): fewshot 74.1% with promotion vs 77.8%
    without (paper defaults); Mooncake, writing all, 17.8% vs 23.3% (23.0% when victims are
    demoted instead, with 66% more writes)."""
    promotion_victims: Literal["drop", "demote"] = "drop"
    """What happens to the engine-tier blocks a promotion displaces: dropped (paper), or
    evicted to the next tier like any other victim (a swap)."""
    promotion_interval_requests: int = Field(default=1, ge=1)
    """Requests between promotion rounds (paper: after each batch's prefill)."""
    promotion_max_blocks: int = Field(default=64, ge=1)
    """Most blocks promoted in one round (the paper bounds a round only by the cold space)."""
    max_tracked_blocks: int = Field(default=262_144, ge=1)
    """Hotness records kept, including blocks no tier holds any more (their frequency stays
    cumulative); beyond it the coldest records of blocks nobody holds are forgotten."""


class WorkloadAwareConfig(Section):
    """The workload-aware eviction of KVCache-in-the-wild (seed-003): per request category an
    exponential reuse-time model fitted online, one LRU queue per category, victim = the lowest
    (reuse probability, -offset) among the queues' heads."""

    fit_window_s: float = Field(default=3600.0, gt=0)
    """Reuse samples older than this are forgotten (paper: fits on hour windows)."""
    refit_interval_s: float = Field(default=60.0, gt=0)
    """How often the per-category models are refitted ("in the background"; not given)."""
    min_samples: int = Field(default=32, ge=1)
    """A category with fewer reuse samples in the window uses the fit of all categories."""
    lifespan_regulator: bool = True
    """Reuse probability 0 past the category's lifespan (paper: +2.4% hit rate in ablation)."""
    lifespan_quantile: float = Field(default=0.99, gt=0, le=1)
    """A category's lifespan = this quantile of its reuse times (paper quotes P99 lifespans)."""
    max_samples_per_category: int = Field(default=65_536, ge=1)
    """Reuse samples kept per category within the window (bounds memory)."""
    max_tracked_blocks: int = Field(default=262_144, ge=1)
    """Last-access records kept, including blocks no tier holds (to measure their reuse)."""


class NextUseConfig(Section):
    """The ``nextuse`` policy (``replica/kvcache/policy/nextuse.py``): each block's next use
    predicted by a table learned online from the cache's own history (per use count and turn),
    and the block predicted furthest away goes first."""

    horizon_s: float = Field(default=600.0, gt=0)
    """A use not followed by another within this long is counted as "not used again"."""
    resolution_s: float = Field(default=0.05, gt=0)
    """Width of the shortest gap bin; the bins double from there."""
    bins: int = Field(default=24, ge=2, le=64)
    """Gap bins per feature cell (24 from 0.05 s reach 9.7 days)."""
    refit_samples: int = Field(default=1024, ge=1)
    """Closed samples between refits of the prediction tables; each refit halves the counts
    before it, so the model follows a change of workload."""
    min_samples: int = Field(default=64, ge=1)
    """A cell with fewer samples borrows the table of the cell one use count below (all cells
    pooled for a block used once); with fewer pooled, recency alone decides (LRU)."""
    max_tracked_blocks: int = Field(default=262_144, ge=1)
    """Blocks whose latest use is remembered, including blocks no tier holds (to measure their
    reuse)."""


SinglePolicyName = Literal["lru", "lfu", "hotprefix", "workload", "nextuse"]
"""The cache policies that decide alone (the adaptive policy's candidates)."""


class AdaptiveConfig(Section):
    """The ``adaptive`` policy (``replica/kvcache/policy/adaptive.py``): the candidates run side
    by side, each on a shadow cache of the same size, and the one that would have hit most
    lately decides."""

    candidates: tuple[SinglePolicyName, ...] = Field(
        default=("lru", "hotprefix", "lfu"), min_length=1
    )
    """In order of preference on a tie (the first leads until another scores more)."""
    half_life_requests: float = Field(default=200.0, gt=0)
    """Requests after which a shadow's hit counts half: how fast the leader follows a change
    of workload."""
