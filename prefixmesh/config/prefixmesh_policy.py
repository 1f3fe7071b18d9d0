"""``routing.prefixmesh``: the settings of prefixmesh's own routing policy
(``router/policy/prefixmesh_policy.py``)."""

from __future__ import annotations

from pydantic import Field

from prefixmesh.config.base import Section


class PrefixmeshPolicyConfig(Section):
    """prefixmesh's own policy: estimated TTFT, affinity groups, delay-hit holds."""

    group_tokens: int = Field(default=256, gt=0)
    """Prompt head that names a prefix group (rounded down to whole blocks)."""
    affinity_enabled: bool = True
    """Replicate hot groups on a consistent-hash subset sized by their traffic."""
    affinity_target_utilization: float = Field(default=0.7, gt=0, le=1)
    """A hot group gets enough ring replicas to keep each near this share of busy time."""
    holds_enabled: bool = True
    """Delay-hit deferral: hold a request on the replica computing its prefix right now."""
    hold_min_tokens: int = Field(default=256, ge=0)
    """Hold only when at least this many tokens of the prefix are in flight (Strata: 100)."""
    hold_wait_factor: float = Field(default=2.0, gt=0)
    """Bound on a hold, as a multiple of the in-flight prefix's expected prefill time."""
    hold_claims: bool = True
    """Claim a cold long prefix in the registry when sending it to be computed (one bounded
    round trip): a sibling routed meanwhile by any ingress, before the speculative entry is
    visible, is held on the claimant instead of computing the prefix again elsewhere."""
    hold_claim_wait_share: float = Field(default=0.5, ge=0)
    """Most a decision waits for its claim (and then its speculative write), as a share of the
    chosen replica's expected prefill of the prompt; at least registry.lookup_deadline_ms, at
    most registry.op_timeout_ms. The claim can save a sibling that whole prefill, and on a
    loaded machine a Redis round trip outlasts the lookup deadline (a late claim counts as
    won: the request computes, and siblings may compute too)."""
    hold_arrival_grace_s: float = Field(default=0.05, ge=0)
    """A replica holds a router-held request that arrives before the request computing its
    prefix (nothing orders two ingresses' calls) this long for that one to start."""
    overload_wait_s: float = Field(default=6.0, ge=0)
    """Per-candidate guard: a replica whose estimated queue wait exceeds the least-loaded
    candidate's by more than this is skipped, whatever it holds. Long prompts need it above
    their recompute elsewhere (66k tokens: 5.6 s on an H100): a holder busy for less than that
    is still the faster choice, which the estimate already makes."""
    near_best_rel: float = Field(default=0.0, ge=0)
    """Replicas within this fraction of the best estimated TTFT count as ties ..."""
    near_best_abs_s: float = Field(default=0.001, ge=0)
    """... or within this many seconds; one tie is picked at random (no herding)."""
    affinity_slack_s: float = Field(default=0.01, ge=0)
    """A hot group's request also spills off its members when the best member's estimate is
    this much worse than the best replica's (recompute included): members busy with other
    work must not queue the group. Infinite: spill only when the guard rejects every member."""
    affinity_hysteresis: float = Field(default=0.25, ge=0)
    """A hot group shrinks from k replicas only once k - 1 would still cover its traffic with
    this much headroom (grows at once): a rate hovering at a boundary does not flap k."""
    affinity_max_groups: int = Field(default=4096, ge=1)
    """Hot groups whose replica count is remembered (least recently routed forgotten first); a
    forgotten group restarts from its measured rate, so the bound only costs hysteresis."""
    affinity_rate_half_life_s: float = Field(default=30.0, gt=0)
    """Half-life of the registry's group counters (keep equal to
    registry.hotness_half_life_s): the policy divides out their warm-up bias with it."""
    affinity_warmup_max_boost: float = Field(default=16.0, ge=1)
    """Most a young group's rate is scaled up for the counter's warm-up (1 = no correction);
    16 trusts a counter from 0.09 half-lives (2.8 s at 30 s) on. Measured on blog (a hot
    prompt from the first second): 4 sizes it for only a quarter of its traffic for the whole
    11 s run (mean TTFT 47.3 ms; 45.0 at 8, 42.4 at 16); 32 gives some groups of the groups workload
    a second member on a few requests' evidence (mean +2.5%)."""
    affinity_min_requests: int = Field(default=8, ge=1)
    """Requests of a group this router must have seen before the group may get a second
    replica: a rate read off a handful of requests, boosted for their youth, buys copies on
    noise. Measured: at 1, the few Mooncake groups that briefly reached k = 2 cost 2.0% mean
    TTFT over 6 seeds (their copies recomputed ~450k tokens); at 8 they stay at k = 1, and blog's
    hot prompt (about 140 requests a second) is sized within its first 60 ms as before."""
    ring_vnodes: int = Field(default=160, ge=1)
    """Points per replica on the affinity ring (uhashring's default): enough for an even share
    of groups per replica at 64 replicas, cheap to rebuild when the fleet changes."""
    min_prefill_share: float = Field(default=0.05, gt=0, le=1)
    """Least share of an engine step left to prefill when running decodes fill the token budget
    (vLLM schedules decodes first): keeps the wait estimate finite on a decode-bound replica."""
    cpu_fallback_credit: float = Field(default=0.75, ge=0, le=1)
    """Share of a CPU-tier block's prefill saved when the replica reports no CPU load time
    (Dynamo's host credit)."""
    disk_fallback_credit: float = Field(default=0.25, ge=0, le=1)
    """Share of a disk-tier block's prefill saved when the replica reports no disk load time
    (Dynamo's disk credit)."""
    recompute_penalty: float = Field(default=0.5, ge=0)
    """Extra cost per second of prefill a replica must compute, on top of the TTFT estimate:
    recomputed work delays every request queued behind it, roughly utilization-many of them,
    so ~0.5 keeps a holder preferred unless it is clearly busier (0 = pure TTFT)."""
    pressure_wait_s: float = Field(default=1.0, gt=0)
    """The recompute penalty grows by 1 for every this many seconds of prefill queued on the
    least-loaded candidate: once every replica is backlogged, recomputing a prefix only
    lengthens the backlog, and a greedy TTFT choice spirals into recomputing everything."""
    overload_wait_rel: float = Field(default=1.5, ge=1)
    """The guard also needs the queue wait above this multiple of the least-loaded one's
    (SGLang's balance_rel_threshold): a uniformly backlogged fleet keeps its affinity."""
    queue_externality: float = Field(default=2.0, ge=0)
    """Weight of the delay a request's first chunk adds to the requests already waiting for
    their first token on a replica (they share its step). 1 = theirs counts as much as its
    own: the estimate then minimises the sum of TTFTs, not this request's alone."""
    hold_memory: int = Field(default=8, ge=0)
    """In-flight prompts remembered per replica (when their blocks should be ready) to price
    a sibling's hold there; 0 = price holds by the replica's queue wait alone."""
    ranking_depth: int = Field(default=8, ge=1)
    """Replicas in a decision's ranking: the chosen one, then the next best by cost. The
    adapter tries them in order; if all refuse it asks again with fresh load."""
    decode_cost_window: int = Field(default=256, ge=0)
    """Finished requests (exponentially weighted) behind the learned step time a running
    request adds (``decode_cost.py``); 0 = do not learn, charge one token's compute."""
    decode_cost_max: float = Field(default=10.0, ge=1)
    """Cap on the learned running cost, in token computes per step."""
    decode_cost_min_output_tokens: int = Field(default=16, ge=2)
    """Only requests generating at least this many tokens give a step-time sample (over
    fewer, the error of the TTFT estimate dominates)."""
    decode_cost_max_tracked: int = Field(default=65_536, ge=1)
    """Routed requests awaiting their finish for a sample, at most (oldest dropped: an
    adapter that reports no finishes costs this much memory, no more)."""
    decode_batch_size: int = Field(default=32, ge=1)
    """Requests sharing one decode step on a busy replica: a generated token costs
    decode_step_s / this of busy time when sizing affinity groups (tune per engine)."""
