"""``kvcache``: the replicas' hierarchical prefix cache, its policy and the tiers under the
engine (the single policies' own settings are in ``kvcache_policy.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section
from prefixmesh.config.kvcache_policy import (
    AdaptiveConfig,
    HotPrefixConfig,
    NextUseConfig,
    SinglePolicyName,
    WorkloadAwareConfig,
)


class KVCacheConfig(Section):
    """The replicas' hierarchical prefix cache: which policy manages the tiers, and its
    parameters (paper defaults where the paper gives one)."""

    policy: Literal[SinglePolicyName, "adaptive"] = "lru"
    """Eviction / admission / promotion policy of every tier. LRU by default: no other policy
    beats it on the cluster simulator's CPU tiers (``nextuse`` does in cache-sim, where the
    policy sees every use: 1.07x on the Mooncake trace; docs/benchmarks-log.md, issue 18),
    and HotPrefix at its defaults admits a block only after 10 uses, so behind the router (a
    group of prompts reused a few times each) the tiers served 2.4% of prompt tokens with it and
    35% with LRU (issue 16's serving-bench)."""
    hotprefix: HotPrefixConfig = HotPrefixConfig()
    """Settings of the ``hotprefix`` policy."""
    workload: WorkloadAwareConfig = WorkloadAwareConfig()
    """Settings of the ``workload`` (workload-aware) policy."""
    adaptive: AdaptiveConfig = AdaptiveConfig()
    """Settings of the ``adaptive`` policy."""
    nextuse: NextUseConfig = NextUseConfig()
    """Settings of the ``nextuse`` (predicted next use) policy."""
    lookahead_requests: int = Field(default=64, ge=0)
    """Tell the policy the prompts of up to this many requests waiting in the engine (vLLM's
    waiting queue, which the KV connector hears of as each request arrives), so that it keeps
    the lower-tier blocks they are about to load (``Lookahead``). 0: off. On by default: in the
    cluster simulator it never lowered the hit rate and cut the mean TTFT of an overloaded
    fleet by a fifth (docs/benchmarks-log.md, issue 18)."""
    cpu_tier_gib: float = Field(default=0.0, ge=0)
    """CPU-memory tier under each vLLM replica's own KV cache (our KV connector; pinned memory
    on CUDA machines), per tensor-parallel rank: each rank keeps its shard of every block.
    0 with ``disk_tier_gib`` 0: no connector."""
    disk_tier_gib: float = Field(default=0.0, ge=0)
    """Disk tier under the CPU tier, in ``disk_dir``, per tensor-parallel rank (0: none)."""
    disk_dir: str = "~/.cache/prefixmesh/kv"
    """Folder of the disk tier; one sub-folder per cache fingerprint and tensor-parallel rank,
    kept across restarts (its index is rebuilt on start)."""
    cpu_read_gb_per_s: float | None = Field(default=None, gt=0)
    """Read bandwidth of the CPU tier used to decide load vs recompute (None: measured at start
    with one large memory copy)."""
    disk_read_gb_per_s: float | None = Field(default=None, gt=0)
    """Read bandwidth of the disk tier (None: measured at start by reading a 32 MiB file back,
    which the page cache may serve)."""
    shared_dir: str = "~/.cache/prefixmesh/kv-shared"
    """Folder of the cluster's shared tier: every replica writes the blocks it computes there
    once and loads any block another replica wrote (a local folder on one machine; a shared
    POSIX file system across several). One sub-folder per cache fingerprint and rank."""
    shared_tier_gib: float = Field(default=0.0, ge=0)
    """Capacity of the shared tier, per tensor-parallel rank, for the whole cluster: past it the
    least recently used blocks go (0: no shared tier)."""
    shared_read_gb_per_s: float | None = Field(default=None, gt=0)
    """Read bandwidth of the shared tier for load vs recompute (None: measured at start, as
    the disk tier's)."""
    shared_scan_interval_s: float = Field(default=1.0, gt=0)
    """How often a replica lists the shared folder (off the engine's step path): a block
    another replica wrote is found at most this much later."""
    async_loads: bool = True
    """Load a request's blocks from the CPU and disk tiers on a loader thread while the engine
    runs the other requests' steps; the request joins the batch once its blocks are in
    (vLLM's asynchronous KV loads). False: every load runs inside the step that needs it,
    and that step waits for it."""
    layerwise_loads: bool = True
    """On CPU engines, load a step's CPU-tier blocks one layer at a time on a copier thread,
    each layer's attention waiting only for its own blocks (vLLM's ``wait_for_layer_load``),
    and with ``async_loads`` let a request whose blocks are all in the CPU tier load inside its
    first step when the copy takes no longer than computing that step's tokens of it (Strata's
    balance), instead of waiting outside the batch. Disk and shared-folder loads never run in
    the step. CUDA engines copy a step's loads on the engine's stream as before."""
    prefetch_blocks: int = Field(default=0, ge=0)
    """With ``async_loads``: while no load is queued, promote the disk and shared-folder blocks
    of requests still waiting in vLLM's queue into the CPU tier, at most this many on their way
    at once, so that their loads are memory copies when their turn comes (0: never). Off by
    default: on a CPU engine the promotions (and the CPU-tier victims they push down to disk)
    slowed the prefill they ran beside by more than they saved (docs/benchmarks-log.md, "Promoting
    waiting requests' blocks ahead of their turn"); 256 is a starting point where the loader's
    work does not share the engine's cores (not measured: no GPU was lent)."""
    load_thread_nice: int = Field(default=10, ge=0, le=19)
    """Niceness of the loader thread (Linux, per thread): above the engine's, so a load takes
    the core only when the engine's compute threads leave it, and decode steps keep their pace."""

    @property
    def tiers_enabled(self) -> bool:
        return self.cpu_tier_gib > 0 or self.disk_tier_gib > 0 or self.shared_tier_gib > 0
