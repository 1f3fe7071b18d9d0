"""Builds the configured registry client (the one place that maps config onto a backend)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.memory import InMemoryRegistry, RegistryState
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.registry_health import InProcessProbe, RedisProbe, RegistryProbe
from prefixmesh.config import PrefixmeshConfig


def make_hasher(config: PrefixmeshConfig) -> BlockHasher:
    cache = config.cache
    return BlockHasher(cache.block_size, config.model, cache.hash_algo, cache.hash_seed)


def make_memory_state(config: PrefixmeshConfig) -> RegistryState:
    reg = config.registry
    return RegistryState(
        max_holders_per_block=reg.max_holders_per_block,
        hotness_half_life_s=reg.hotness_half_life_s,
    )


def make_registry(
    config: PrefixmeshConfig,
    state: RegistryState | None = None,
    lock: AbstractContextManager[Any] | None = None,
) -> CacheRegistry:
    """A registry client. In-process clients of one process share ``state``, and take ``lock``
    around every use of it (the lock its other users take; none: the caller serialises)."""
    reg = config.registry
    fingerprint = make_hasher(config).fingerprint
    if reg.backend == "memory":
        shared = state if state is not None else make_memory_state(config)
        return InMemoryRegistry(fingerprint, shared, lock)
    return RedisRegistry(
        fingerprint,
        RedisEndpoint.from_config(reg),
        namespace=reg.namespace,
        max_holders_per_block=reg.max_holders_per_block,
        hotness_half_life_s=reg.hotness_half_life_s,
        op_timeout_s=reg.op_timeout_ms / 1000,
        publish_timeout_s=reg.publish_timeout_ms / 1000,
    )


def make_registry_probe(config: PrefixmeshConfig, timeout_s: float | None = None) -> RegistryProbe:
    """The health probe of the configured registry: one call bounded by ``timeout_s`` (default:
    the registry's op timeout). Use it from one event loop."""
    reg = config.registry
    if reg.backend == "memory":
        return InProcessProbe()
    return RedisProbe(
        RedisEndpoint.from_config(reg),
        make_hasher(config).fingerprint,
        reg.namespace,
        reg.op_timeout_ms / 1000 if timeout_s is None else timeout_s,
    )
