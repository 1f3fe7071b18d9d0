"""The one typed config of a prefixmesh cluster, loaded once (YAML in manifests/ + overrides).

One module per section or group of sections (``cache``, ``registry``, ``routing`` with
``prefixmesh_policy``, ``replica`` with ``engine``, ``serving``, ``limits``, ``tenants``,
``telemetry``, ``kvcache`` with ``kvcache_policy``), the root ``PrefixmeshConfig`` in ``root``,
and one loader, ``load`` (file, overrides, environment, secrets). Leaf classes never read the
config's file or the environment: entry points call ``load_config`` and pass scalars or
sub-configs down.
"""

from prefixmesh.config.cache import ENGINE_BLOCK_SIZES, CacheConfig
from prefixmesh.config.engine import RemoteEngineConfig, SimEngineConfig, VllmConfig
from prefixmesh.config.kvcache import KVCacheConfig
from prefixmesh.config.kvcache_policy import (
    AdaptiveConfig,
    HotPrefixConfig,
    NextUseConfig,
    SinglePolicyName,
    WorkloadAwareConfig,
)
from prefixmesh.config.limits import LimitsConfig
from prefixmesh.config.load import (
    CONFIG_ENV,
    REDIS_URL_ENV,
    load_config,
    merge_overrides,
    merge_settings,
    parse_override,
    process_json,
    resolve_auth_environment,
    resolve_registry_environment,
)
from prefixmesh.config.prefixmesh_policy import PrefixmeshPolicyConfig
from prefixmesh.config.registry import (
    REDIS_PASSWORD_ENV,
    REDIS_SCHEMES,
    RegistryConfig,
    split_url_password,
)
from prefixmesh.config.replica import FairShareConfig, ReplicaConfig
from prefixmesh.config.root import PrefixmeshConfig
from prefixmesh.config.routing import (
    DynamoConfig,
    PrefixHashConfig,
    RayPrefixConfig,
    RoutingConfig,
    SGLangConfig,
)
from prefixmesh.config.serving import IngressConfig, RayConfig, ServingConfig
from prefixmesh.config.telemetry import MetricsConfig, TelemetryConfig
from prefixmesh.config.tenants import API_KEYS_ENV, AuthConfig, QuotasConfig, TenantQuota

__all__ = [
    "API_KEYS_ENV",
    "CONFIG_ENV",
    "ENGINE_BLOCK_SIZES",
    "REDIS_PASSWORD_ENV",
    "REDIS_SCHEMES",
    "REDIS_URL_ENV",
    "AdaptiveConfig",
    "AuthConfig",
    "CacheConfig",
    "DynamoConfig",
    "FairShareConfig",
    "HotPrefixConfig",
    "IngressConfig",
    "KVCacheConfig",
    "LimitsConfig",
    "MetricsConfig",
    "NextUseConfig",
    "PrefixHashConfig",
    "PrefixmeshConfig",
    "PrefixmeshPolicyConfig",
    "QuotasConfig",
    "RayConfig",
    "RayPrefixConfig",
    "RegistryConfig",
    "RemoteEngineConfig",
    "ReplicaConfig",
    "RoutingConfig",
    "SGLangConfig",
    "ServingConfig",
    "SimEngineConfig",
    "SinglePolicyName",
    "TelemetryConfig",
    "TenantQuota",
    "VllmConfig",
    "WorkloadAwareConfig",
    "load_config",
    "merge_overrides",
    "merge_settings",
    "parse_override",
    "process_json",
    "resolve_auth_environment",
    "resolve_registry_environment",
    "split_url_password",
]
