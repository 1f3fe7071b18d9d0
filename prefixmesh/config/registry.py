"""``registry``: where the cluster's cache registry lives, how long its calls may take, and
the Redis URL helpers."""

from __future__ import annotations

from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, SerializationInfo, field_serializer, model_validator

from prefixmesh.config.base import Section, dump_secret

REDIS_PASSWORD_ENV = "PREFIXMESH_REDIS_PASSWORD"
"""Default of ``registry.redis_password_env``: the variable holding the Redis password."""
REDIS_SCHEMES = ("redis", "rediss")


class RegistryConfig(Section):
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
    Redis answers a 64-block x 64-replica lookup in well under 1 ms (docs/benchmarks-log.md)."""
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
        return dump_secret(password, info)

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
