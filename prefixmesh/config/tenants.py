"""``auth``, ``quotas``: the API keys that name a request's tenant, and each tenant's quota."""

from __future__ import annotations

from pydantic import Field, SecretStr, SerializationInfo, field_serializer

from prefixmesh.config.base import Section, dump_secret

API_KEYS_ENV = "PREFIXMESH_API_KEYS"
"""Default of ``auth.api_keys_env``: the variable holding API keys."""


class AuthConfig(Section):
    """API keys (``prefixmesh/api/auth.py``): off unless ``api_keys_file`` or the variable
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
        return dump_secret(keys, info)


class TenantQuota(Section):
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


class QuotasConfig(Section):
    """Token quotas per tenant (``prefixmesh/api/quota.py``): off while every limit is 0.

    The tenant is the one the request's API key names (``auth``); without keys every request
    belongs to ``anonymous``. Counted across the cluster in the registry's Redis (one atomic
    script a request), in the process with the ``memory`` registry. A request over its
    tenant's quota gets OpenAI's 429 (``rate_limit_exceeded``) with ``retry-after``."""

    default: TenantQuota = TenantQuota()
    """Every tenant not named in ``tenants``."""
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
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
