"""Shared cache vocabulary (block hashing, keys, events) and the cache registry backends."""

from prefixmesh.cache_registry.hashing import (
    BlockHasher,
    CacheFingerprint,
    FingerprintMismatchError,
)
from prefixmesh.cache_registry.memory import InMemoryRegistry, RegistryState
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.types import (
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixHit,
    PrefixKey,
    PublishResult,
    RegistryStats,
    ReplicaId,
    Tier,
)

__all__ = [
    "BlockHash",
    "BlockHasher",
    "CacheEvent",
    "CacheFingerprint",
    "CacheRegistry",
    "EventKind",
    "FingerprintMismatchError",
    "InMemoryRegistry",
    "PrefixHit",
    "PrefixKey",
    "PublishResult",
    "RegistryState",
    "RegistryStats",
    "ReplicaId",
    "Tier",
]
