from __future__ import annotations

from prefixmesh.cache_registry.factory import make_hasher, make_registry
from prefixmesh.cache_registry.memory import InMemoryRegistry
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.config import load_config


async def test_config_picks_the_backend_and_the_fingerprint() -> None:
    config = load_config(overrides=["cache.block_size=32", "model=m"])
    memory = make_registry(config)
    assert isinstance(memory, InMemoryRegistry)
    assert memory.fingerprint == make_hasher(config).fingerprint
    assert memory.fingerprint.block_size == 32
    redis_config = load_config(overrides=["registry.backend=redis"])
    redis = make_registry(redis_config)
    assert isinstance(redis, RedisRegistry)
    await redis.close()
