"""Where a Redis registry lives and how to reach it: URL, password, TLS (one typed value).

The password never enters a URL, a repr or a message: ``RedisEndpoint.url`` carries none (a
URL given with one has it moved out), and the field is left out of the repr. Both redis-py
clients (asyncio for the registry, sync for the test server's readiness check) are built from
the same options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

from prefixmesh.config import RegistryConfig, split_url_password


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    url: str
    """``redis://`` or ``rediss://`` (TLS) URL, without a password (safe to log)."""
    password: str | None = field(default=None, repr=False)
    password_source: str = ""
    """Where the password comes from, for messages (``$PREFIXMESH_REDIS_PASSWORD``)."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True

    def __post_init__(self) -> None:
        if split_url_password(self.url)[1] is not None:
            raise ValueError("RedisEndpoint.url must not carry a password: use RedisEndpoint.of")

    @classmethod
    def of(cls, url: str, password: str | None = None, **settings: Any) -> RedisEndpoint:
        """An endpoint from a URL that may carry a password (``password`` wins over it)."""
        bare, in_url = split_url_password(url)
        return cls(bare, password if password is not None else in_url, **settings)

    @classmethod
    def from_config(cls, registry: RegistryConfig) -> RedisEndpoint:
        password = registry.redis_password
        return cls(
            registry.redis_url,
            None if password is None else password.get_secret_value(),
            f"${registry.redis_password_env}",
            registry.redis_tls_ca_file,
            registry.redis_tls_cert_file,
            registry.redis_tls_key_file,
            registry.redis_tls_verify,
        )

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "rediss"

    def client_options(self) -> dict[str, Any]:
        """redis-py keyword arguments (both clients) for the password and TLS."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options["password"] = self.password
        if self.tls:
            options.update(
                ssl_ca_certs=self.tls_ca_file,
                ssl_certfile=self.tls_cert_file,
                ssl_keyfile=self.tls_key_file,
                ssl_cert_reqs="required" if self.tls_verify else "none",
                ssl_check_hostname=self.tls_verify,
            )
        return options

    def async_client(self, **kwargs: Any) -> aioredis.Redis:
        return aioredis.Redis.from_url(self.url, **self.client_options(), **kwargs)

    def sync_client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, **self.client_options(), **kwargs)
