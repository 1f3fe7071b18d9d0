"""Is the configured registry usable? One bounded probe, and what its failure means.

``/health`` of the router and the ingress, ``prefixmesh serve``'s start-up check and the
``prefixmesh_registry_degraded`` gauge all read a ``RegistryHealth``: ok, or degraded with a
reason code (the gauge's label) and a message an operator can act on. Messages name the
server by its password-free URL and never contain the password (``diagnose`` scrubs it even
from the server's own words).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixmesh.cache_registry.hashing import CacheFingerprint
from prefixmesh.cache_registry.redis_connection import RedisEndpoint

DEGRADED_REASONS = ("unreachable", "timeout", "auth", "tls", "fingerprint", "error")
"""``unreachable``: no connection (refused, no route, closed); ``timeout``: no answer within
the registry's op timeout; ``auth``: the password is missing or refused; ``tls``: the TLS
handshake failed (certificate, or TLS against a plain port); ``fingerprint``: the registry
holds another cluster's cache fingerprint; ``error``: anything else."""


@dataclass(frozen=True, slots=True)
class RegistryHealth:
    reason: str = ""
    """``""`` when healthy, else one of ``DEGRADED_REASONS``."""
    message: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    def body(self) -> dict[str, str]:
        """The JSON of ``/health`` (always answered 200: routing goes on without a registry)."""
        if self.ok:
            return {"status": "ok"}
        return {"status": "degraded", "reason": self.message, "code": self.reason}


HEALTHY = RegistryHealth()


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def diagnose(exc: BaseException, endpoint: RedisEndpoint) -> RegistryHealth:
    """What a failed registry call says about the registry (pure)."""
    url = endpoint.url
    detail = str(exc) or type(exc).__name__
    source = endpoint.password_source or "the registry's password setting"
    chain = _chain(exc)
    if any(isinstance(e, AuthenticationError) for e in chain):
        if endpoint.password is None:
            health = RegistryHealth(
                "auth", f"{url} requires a password and none was given: set {source}"
            )
        else:
            health = RegistryHealth("auth", f"{url} refused the password from {source} ({detail})")
    elif any(isinstance(e, ssl.SSLError) for e in chain) or "SSL" in detail:
        hint = ""
        if "WRONG_VERSION_NUMBER" in detail.upper() or "wrong version number" in detail:
            hint = "; is the server plain Redis? then use redis://"
        elif "CERTIFICATE_VERIFY_FAILED" in detail.upper():
            hint = "; check registry.redis_tls_ca_file"
        health = RegistryHealth("tls", f"TLS with {url} failed: {detail}{hint}")
    elif any(isinstance(e, (TimeoutError, RedisTimeoutError)) for e in chain):
        hint = "; if the server is plain Redis, use redis://" if endpoint.tls else ""
        health = RegistryHealth("timeout", f"{url} did not answer in time ({detail}){hint}")
    elif any(isinstance(e, (RedisConnectionError, OSError)) for e in chain):
        hint = ""
        if any(word in detail.lower() for word in ("closed", "reset")):
            # A TLS server drops a plain client, or a TLS client without the certificate it
            # demands, without a word.
            if not endpoint.tls:
                hint = "; if the server accepts only TLS, use rediss://"
            elif endpoint.tls_cert_file is None:
                hint = (
                    "; if the server demands client certificates, set registry.redis_tls_cert_file"
                )
        health = RegistryHealth("unreachable", f"cannot reach {url}: {detail}{hint}")
    else:
        health = RegistryHealth("error", f"{url} failed: {type(exc).__name__}: {detail}")
    return scrub(health, endpoint.password)


def scrub(health: RegistryHealth, password: str | None) -> RegistryHealth:
    """``health`` with every occurrence of ``password`` masked (servers do not echo it; this
    makes sure)."""
    if not password or password not in health.message:
        return health
    return RegistryHealth(health.reason, health.message.replace(password, "***"))


def fingerprint_mismatch(
    endpoint: RedisEndpoint, namespace: str, stored: str, mine: CacheFingerprint
) -> RegistryHealth:
    return RegistryHealth(
        "fingerprint",
        f"{endpoint.url} namespace {namespace!r} holds another cluster's cache fingerprint "
        f"{stored}, this process uses {mine.to_json()}: clusters sharing one Redis need "
        "different registry.namespace values",
    )


class RegistryProbe(Protocol):
    async def check(self) -> RegistryHealth:
        """The registry's health, within the registry's op timeout; never raises."""
        ...

    async def close(self) -> None: ...


class InProcessProbe:
    """The in-process registry lives inside this process: always healthy."""

    async def check(self) -> RegistryHealth:
        return HEALTHY

    async def close(self) -> None:
        return None


class RedisProbe:
    """One GET of the registry's recorded fingerprint, compared with ours: proves the server
    answers, accepts our password and TLS, and belongs to this cluster. A verdict younger
    than ``max_age_s`` is reused and concurrent checks share one probe, so a flood of health
    checks costs Redis one call a ``max_age_s``. Use from one event loop (its client's)."""

    def __init__(
        self,
        endpoint: RedisEndpoint,
        fingerprint: CacheFingerprint,
        namespace: str,
        timeout_s: float,
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self._fingerprint = fingerprint
        self._namespace = namespace
        self._key = "{" + namespace + "}:fp"
        self._timeout_s = timeout_s
        self._max_age_s = max_age_s
        self._clock = clock
        self._client = endpoint.async_client(
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._last: tuple[float, RegistryHealth] | None = None
        self._running: asyncio.Task[RegistryHealth] | None = None

    async def check(self) -> RegistryHealth:
        if self._last is not None and self._clock() - self._last[0] < self._max_age_s:
            return self._last[1]
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> RegistryHealth:
        started = self._clock()
        try:
            stored = await asyncio.wait_for(self._client.get(self._key), self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            health = diagnose(exc, self.endpoint)
        else:
            mine = self._fingerprint.to_json()
            if stored is not None and stored != mine:
                recorded = cast(str, stored)  # decode_responses=True: replies are str
                health = fingerprint_mismatch(
                    self.endpoint, self._namespace, recorded, self._fingerprint
                )
            else:
                health = HEALTHY  # none recorded yet: the first registry client records ours
        self._last = (started, health)
        return health

    async def close(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()
        await self._client.aclose()
