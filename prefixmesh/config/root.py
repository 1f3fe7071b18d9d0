"""The root of the config, ``PrefixmeshConfig``: every section, and the checks across them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from prefixmesh.config.base import Section
from prefixmesh.config.cache import ENGINE_BLOCK_SIZES, CacheConfig
from prefixmesh.config.kvcache import KVCacheConfig
from prefixmesh.config.limits import LimitsConfig
from prefixmesh.config.registry import RegistryConfig
from prefixmesh.config.replica import ReplicaConfig
from prefixmesh.config.routing import RoutingConfig
from prefixmesh.config.serving import IngressConfig, RayConfig, ServingConfig
from prefixmesh.config.telemetry import MetricsConfig, TelemetryConfig
from prefixmesh.config.tenants import AuthConfig, QuotasConfig


def _engine_block_size(replica: Any) -> int:
    """``ENGINE_BLOCK_SIZES`` of the engine that ``replica`` (a section, or its raw settings)
    names. An unknown engine fails its own validation: any size then keeps that error the only
    one."""
    engine: Any = ReplicaConfig.model_fields["engine"].default
    if isinstance(replica, ReplicaConfig):
        engine = replica.engine
    elif isinstance(replica, Mapping):
        engine = replica.get("engine", engine)
    size = ENGINE_BLOCK_SIZES.get(engine) if isinstance(engine, str) else None
    return ENGINE_BLOCK_SIZES["vllm"] if size is None else size


class PrefixmeshConfig(Section):
    model: str = "demo-tiny"
    """Model name served by the cluster; part of the cache fingerprint."""
    cache: CacheConfig
    """Block size and hashing: the cache fingerprint shared by router, replicas and registry
    (given or not: its block size is filled in before validation)."""
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
        (``replica/events/progress.py``): on the direct path Serve's callbacks do not run, and with
        the in-process registry the one router is where the replicas' events go already. Its
        ledger is then as exact as the proxy path's."""
        return self.serving.path == "direct" and self.registry.backend == "memory"

    @model_validator(mode="before")
    @classmethod
    def _resolve_block_size(cls, data: Any) -> Any:
        """The one place ``cache.block_size`` is resolved: unset (absent or null), it becomes
        the engine's, so the section always holds an int."""
        if not isinstance(data, Mapping):
            return data
        cache = data.get("cache")
        if cache is None:
            cache = {}
        elif not isinstance(cache, Mapping) or cache.get("block_size") is not None:
            return data  # a built section (always sized), or a mistake its validation names
        size = _engine_block_size(data.get("replica"))
        return {**data, "cache": {**cache, "block_size": size}}

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
