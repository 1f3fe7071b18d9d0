"""The Redis registry against real redis-server processes with ``requirepass`` and TLS only:
the right password and certificates work, a wrong or missing password and a plain client on a
TLS port fail at once with a reason that names the problem and never the password."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from prefixmesh.cache_registry.factory import make_registry, make_registry_probe
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.registry_health import RedisProbe, RegistryHealth
from prefixmesh.cache_registry.types import CacheEvent, EventKind, PrefixHit, ReplicaId, Tier
from prefixmesh.config import REDIS_PASSWORD_ENV, REDIS_URL_ENV, load_config
from prefixmesh.loadtest.local_redis import LocalRedisServer, TLSUnsupportedError
from prefixmesh.serve_cli import registry_warning
from tests.integration.cache_registry.conftest import HASHER

pytestmark = pytest.mark.redis
PASSWORD = 'c0rrect "horse" \\ battery'
R1 = ReplicaId("replica-1")
KEY = HASHER.hash_tokens(list(range(16)))
OP_TIMEOUT_S = 2.0
"""Generous: a TLS handshake on a loaded 2-core machine can take a good part of a second."""
HANG_S = 10.0
"""Far beyond any bound below: only a hang reaches it."""


@pytest.fixture(scope="module")
def password_server() -> Iterator[LocalRedisServer]:
    with LocalRedisServer(password=PASSWORD) as server:
        yield server


def _tls_server(**settings: object) -> LocalRedisServer:
    try:
        return LocalRedisServer(tls=True, **settings)  # type: ignore[arg-type]
    except TLSUnsupportedError as exc:
        pytest.skip(f"no TLS-capable redis-server here ({exc}); make install-dev installs one")


@pytest.fixture(scope="module")
def tls_server() -> Iterator[LocalRedisServer]:
    with _tls_server(password=PASSWORD, tls_auth_clients=True) as server:
        yield server


def registry_for(endpoint: RedisEndpoint) -> RedisRegistry:
    return RedisRegistry(
        HASHER.fingerprint,
        endpoint,
        namespace=f"t-{uuid.uuid4().hex[:8]}",
        op_timeout_s=OP_TIMEOUT_S,
        backoff_max_s=0.1,  # a failing client's pub/sub retries, and close() waits for one
    )


@pytest.fixture
async def clients() -> AsyncIterator[list[RedisRegistry]]:
    made: list[RedisRegistry] = []
    yield made
    for client in made:
        await client.close()


async def works(registry: RedisRegistry) -> None:
    await asyncio.wait_for(registry.connect(), HANG_S)
    assert registry.verified and registry.health.ok
    event = CacheEvent(EventKind.STORED, R1, 0, 1, Tier.GPU, KEY.block_hashes)
    [result] = await registry.publish([event])
    assert result.applied == 1 and not result.failed
    hits = await registry.lookup(KEY, [R1], deadline_s=OP_TIMEOUT_S)
    assert hits == {R1: PrefixHit(4, (4, 0, 0))}


async def fails(registry: RedisRegistry, reason: str, caplog: pytest.LogCaptureFixture) -> str:
    """Connect fails at once (no hang, no exception), with ``reason``; returns the message."""
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(registry.connect(), HANG_S)
    health = registry.health
    assert health.reason == reason, health
    assert not registry.verified
    assert await registry.lookup(KEY, [R1], deadline_s=0.5) == {}
    assert registry.stats.last_error == health.message
    assert health.message in caplog.text  # the log says what the health says
    assert PASSWORD not in caplog.text and PASSWORD not in health.message
    return health.message


def test_the_password_is_not_on_the_server_s_command_line(
    password_server: LocalRedisServer,
) -> None:
    assert password_server.pid is not None
    cmdline = Path(f"/proc/{password_server.pid}/cmdline").read_bytes().decode()
    assert PASSWORD not in cmdline and "requirepass" not in cmdline


async def test_the_right_password_works(
    password_server: LocalRedisServer, clients: list[RedisRegistry]
) -> None:
    clients.append(registry := registry_for(password_server.endpoint()))
    await works(registry)


async def test_a_wrong_password_is_named_as_such(
    password_server: LocalRedisServer,
    clients: list[RedisRegistry],
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = RedisEndpoint(password_server.url, "wrong", "$PREFIXMESH_REDIS_PASSWORD")
    clients.append(registry := registry_for(endpoint))
    message = await fails(registry, "auth", caplog)
    assert "refused the password from $PREFIXMESH_REDIS_PASSWORD" in message
    assert password_server.url in message and "wrong" not in message.split("(")[0]


async def test_a_missing_password_is_named_as_such(
    password_server: LocalRedisServer,
    clients: list[RedisRegistry],
    caplog: pytest.LogCaptureFixture,
) -> None:
    clients.append(registry := registry_for(RedisEndpoint(password_server.url)))
    message = await fails(registry, "auth", caplog)
    assert "requires a password and none was given" in message


async def test_tls_with_the_generated_ca_and_client_certificate_works(
    tls_server: LocalRedisServer, clients: list[RedisRegistry]
) -> None:
    assert tls_server.url.startswith("rediss://")
    clients.append(registry := registry_for(tls_server.endpoint()))
    await works(registry)


async def test_tls_without_client_auth_needs_only_the_ca(clients: list[RedisRegistry]) -> None:
    with _tls_server() as server:
        endpoint = RedisEndpoint(server.url, tls_ca_file=server.ca_file)
        clients.append(registry := registry_for(endpoint))
        await works(registry)


async def test_a_plain_client_on_the_tls_port_fails_clearly(
    tls_server: LocalRedisServer,
    clients: list[RedisRegistry],
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = tls_server.url.replace("rediss://", "redis://")
    clients.append(registry := registry_for(RedisEndpoint(plain, PASSWORD)))
    message = await fails(registry, "unreachable", caplog)
    assert "use rediss://" in message


async def test_an_unknown_ca_fails_the_handshake(
    tls_server: LocalRedisServer,
    clients: list[RedisRegistry],
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = tls_server.endpoint()
    clients.append(registry := registry_for(RedisEndpoint(endpoint.url, PASSWORD)))
    message = await fails(registry, "tls", caplog)
    assert "CERTIFICATE_VERIFY_FAILED" in message and "registry.redis_tls_ca_file" in message


async def test_the_config_s_environment_reaches_a_tls_registry_with_a_password(
    tls_server: LocalRedisServer,
) -> None:
    environ = {REDIS_URL_ENV: tls_server.url, REDIS_PASSWORD_ENV: PASSWORD}
    config = load_config(
        overrides=[
            "registry.backend=redis",
            f"registry.namespace=t-{uuid.uuid4().hex[:8]}",
            f"registry.op_timeout_ms={OP_TIMEOUT_S * 1000}",
            f"registry.redis_tls_ca_file={tls_server.ca_file}",
            f"registry.redis_tls_cert_file={tls_server.client_cert_file}",
            f"registry.redis_tls_key_file={tls_server.client_key_file}",
        ],
        environ=environ,
    )
    registry = make_registry(config)
    assert isinstance(registry, RedisRegistry)
    try:
        await works(registry)
    finally:
        await registry.close()
    probe = make_registry_probe(config)
    assert await probe.check() == RegistryHealth()
    await probe.close()


async def test_the_probe_names_each_problem(
    password_server: LocalRedisServer, tls_server: LocalRedisServer
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:8]}"

    async def check(endpoint: RedisEndpoint, fingerprint: object = HASHER.fingerprint) -> str:
        probe = RedisProbe(endpoint, fingerprint, namespace, OP_TIMEOUT_S)  # type: ignore[arg-type]
        try:
            health = await asyncio.wait_for(probe.check(), HANG_S)
        finally:
            await probe.close()
        assert PASSWORD not in health.message
        return health.reason

    assert await check(password_server.endpoint()) == ""  # nothing recorded yet: fine
    registry = RedisRegistry(HASHER.fingerprint, password_server.endpoint(), namespace=namespace)
    await registry.connect()  # records this cluster's fingerprint
    await registry.close()
    assert await check(password_server.endpoint()) == ""
    other_cluster = BlockHasher(64, "another-model").fingerprint
    assert await check(password_server.endpoint(), other_cluster) == "fingerprint"
    assert await check(RedisEndpoint(password_server.url, "nope")) == "auth"
    assert await check(RedisEndpoint(password_server.url)) == "auth"
    plain_on_tls = tls_server.url.replace("rediss://", "redis://")
    assert await check(RedisEndpoint(plain_on_tls, PASSWORD)) == "unreachable"
    assert await check(RedisEndpoint(tls_server.url, PASSWORD)) == "tls"


def test_serve_warns_at_start_about_a_refused_password(password_server: LocalRedisServer) -> None:
    def warning(password: str) -> str | None:
        environ = {REDIS_URL_ENV: password_server.url, REDIS_PASSWORD_ENV: password}
        return registry_warning(load_config(overrides=["registry.backend=redis"], environ=environ))

    refused = warning("wrong-one")
    assert refused is not None and "degraded (auth)" in refused
    assert "refused the password from $PREFIXMESH_REDIS_PASSWORD" in refused
    assert "wrong-one" not in refused
    assert warning(PASSWORD) is None
