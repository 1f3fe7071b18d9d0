"""Registry endpoints and health verdicts: the password stays out of URLs, reprs and messages,
each failure gets its reason, the probe is bounded and reuses a fresh verdict."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixmesh.cache_registry.factory import make_hasher, make_registry_probe
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.cache_registry.registry_health import (
    HEALTHY,
    InProcessProbe,
    RedisProbe,
    RegistryHealth,
    diagnose,
)
from prefixmesh.config import REDIS_PASSWORD_ENV, REDIS_URL_ENV, load_config
from prefixmesh.ports import free_port
from tests.fakes.clock import FakeClock

SECRET = "hunter2-secret"
PLAIN = RedisEndpoint("redis://10.0.0.5:16379/0", SECRET, "$PREFIXMESH_REDIS_PASSWORD")
TLS = RedisEndpoint("rediss://10.0.0.5:16379/0", SECRET, tls_ca_file="/ca.pem")


def test_an_endpoint_keeps_the_password_out_of_its_url_and_repr() -> None:
    endpoint = RedisEndpoint.of(f"redis://app:{SECRET}@h:1/0")
    assert (endpoint.url, endpoint.password) == ("redis://app@h:1/0", SECRET)
    assert SECRET not in repr(endpoint)
    assert RedisEndpoint.of(f"redis://:{SECRET}@h:1/0", "other").password == "other"
    with pytest.raises(ValueError, match="must not carry a password"):
        RedisEndpoint(f"redis://:{SECRET}@h:1/0")


def test_client_options_carry_the_password_and_tls_only_for_rediss() -> None:
    assert PLAIN.client_options() == {"password": SECRET}
    assert RedisEndpoint("redis://h:1/0").client_options() == {}
    assert TLS.client_options() == {
        "password": SECRET,
        "ssl_ca_certs": "/ca.pem",
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }
    unverified = RedisEndpoint("rediss://h:1/0", tls_verify=False).client_options()
    assert (unverified["ssl_cert_reqs"], unverified["ssl_check_hostname"]) == ("none", False)


def test_the_endpoint_comes_from_the_resolved_config() -> None:
    environ = {REDIS_URL_ENV: "rediss://head:6380/0", REDIS_PASSWORD_ENV: SECRET}
    config = load_config(
        overrides=["registry.backend=redis", "registry.redis_tls_ca_file=/ca.pem"], environ=environ
    )
    endpoint = RedisEndpoint.from_config(config.registry)
    assert endpoint == RedisEndpoint(
        "rediss://head:6380/0", SECRET, "$PREFIXMESH_REDIS_PASSWORD", "/ca.pem"
    )


def _handshake_failure() -> BaseException:
    exc = RedisConnectionError("Error while reading")
    exc.__cause__ = ssl.SSLError(1, "alert handshake failure")
    return exc


@pytest.mark.parametrize(
    ("exc", "endpoint", "reason", "words"),
    [
        (AuthenticationError("Authentication required."), RedisEndpoint("redis://h:1/0"), "auth",
         ["requires a password and none was given", "redis://h:1/0"]),
        (AuthenticationError("invalid username-password pair"), PLAIN, "auth",
         ["refused the password from $PREFIXMESH_REDIS_PASSWORD"]),
        (RedisConnectionError("Error 1 connecting. [SSL: CERTIFICATE_VERIFY_FAILED] bad"), TLS,
         "tls", ["TLS with rediss://", "registry.redis_tls_ca_file"]),
        (_handshake_failure(), TLS, "tls", ["TLS with"]),
        (TimeoutError(), TLS, "timeout", ["did not answer in time", "use redis://"]),
        (RedisTimeoutError("Timeout reading"), PLAIN, "timeout", ["did not answer in time"]),
        (RedisConnectionError("Error 111 connecting to 10.0.0.5:16379. Connection refused."),
         PLAIN, "unreachable", ["cannot reach redis://10.0.0.5:16379/0", "refused"]),
        (RedisConnectionError("Error while reading: Connection reset by peer"), PLAIN,
         "unreachable", ["use rediss://"]),
        (ValueError("odd"), PLAIN, "error", ["ValueError: odd"]),
    ],
)  # fmt: skip
def test_each_failure_gets_its_reason(
    exc: BaseException, endpoint: RedisEndpoint, reason: str, words: list[str]
) -> None:
    health = diagnose(exc, endpoint)
    assert health.reason == reason and not health.ok
    for word in words:
        assert word in health.message
    assert SECRET not in health.message


def test_a_message_that_quotes_the_password_is_scrubbed() -> None:
    health = diagnose(RedisConnectionError(f"server said {SECRET}"), PLAIN)
    assert SECRET not in health.message and "***" in health.message


def test_health_bodies() -> None:
    assert HEALTHY.body() == {"status": "ok"}
    body = RegistryHealth("auth", "redis://h:1/0 refused the password").body()
    assert body == {
        "status": "degraded",
        "reason": "redis://h:1/0 refused the password",
        "code": "auth",
    }


async def test_the_in_process_registry_is_always_healthy() -> None:
    probe = make_registry_probe(load_config(environ={}))
    assert isinstance(probe, InProcessProbe)
    assert await probe.check() == HEALTHY


async def test_an_unreachable_registry_is_degraded_and_the_verdict_is_reused() -> None:
    clock = FakeClock()
    endpoint = RedisEndpoint(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    fingerprint = BlockHasher(4, "m").fingerprint
    probe = RedisProbe(endpoint, fingerprint, "ns", timeout_s=1.0, max_age_s=1.0, clock=clock)
    calls = 0
    probe_once = probe._probe

    async def counted() -> RegistryHealth:
        nonlocal calls
        calls += 1
        return await probe_once()

    probe._probe = counted  # type: ignore[method-assign]
    first, second = await asyncio.gather(probe.check(), probe.check())  # share one probe
    assert first.reason == "unreachable" and second == first and calls == 1
    clock.advance(0.5)
    assert await probe.check() == first and calls == 1  # fresh enough: reused
    clock.advance(0.6)
    assert (await probe.check()).reason == "unreachable" and calls == 2
    await probe.close()


async def test_the_factory_probe_uses_the_config() -> None:
    environ = {REDIS_URL_ENV: f"redis://127.0.0.1:{free_port()}/0", REDIS_PASSWORD_ENV: SECRET}
    config = load_config(overrides=["registry.backend=redis"], environ=environ)
    probe = make_registry_probe(config)
    assert isinstance(probe, RedisProbe)
    assert probe.endpoint.password == SECRET and probe.endpoint.url == environ[REDIS_URL_ENV]
    health = await probe.check()
    assert health.reason == "unreachable" and SECRET not in health.message
    assert make_hasher(config).fingerprint.model == config.model
    await probe.close()
