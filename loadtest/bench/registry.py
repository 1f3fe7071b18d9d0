"""``prefixmesh registry-bench``: lookup latency, publish throughput and memory per entry.

Every replica holds every prompt (the worst case for a lookup: each block has N holders and the
walk never stops early). Without ``--redis-url`` a private redis-server is started on loopback
and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path

import redis.asyncio as aioredis

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.memory import InMemoryRegistry, RegistryState
from prefixmesh.cache_registry.protocol import CacheRegistry
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.types import CacheEvent, EventKind, PrefixKey, ReplicaId, Tier
from prefixmesh.cli_help import command_parser
from prefixmesh.loadtest.local_redis import LocalRedisServer


@dataclass(frozen=True)
class BenchResult:
    backend: str
    replicas: int
    blocks: int
    prompts: int
    lookups: int
    block_entries: int
    lookup_p50_ms: float
    lookup_p99_ms: float
    lookup_mean_ms: float
    publish_blocks_per_s: float
    bytes_per_block_entry: float
    hash_4096_tokens_ms: float
    redis_version: str


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_hashing(block_size: int, repeats: int = 2000) -> float:
    hasher = BlockHasher(block_size, "bench")
    tokens = list(range(4096))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        hasher.hash_tokens(tokens)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


async def _redis_used_memory(url: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("memory")
        return int(info["used_memory"])
    finally:
        await client.aclose()


async def _redis_version(url: str) -> str:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return str((await client.info("server"))["redis_version"])
    finally:
        await client.aclose()


async def run_bench(args: argparse.Namespace, redis_url: str | None) -> BenchResult:
    hasher = BlockHasher(16, "bench")
    rng = random.Random(args.seed)
    keys: list[PrefixKey] = [
        hasher.hash_tokens([rng.randrange(50_000) for _ in range(args.blocks * 16)])
        for _ in range(args.prompts)
    ]
    replicas = [ReplicaId(f"replica-{i:03d}") for i in range(args.replicas)]
    registry: CacheRegistry
    if redis_url is None:
        registry = InMemoryRegistry(
            hasher.fingerprint, RegistryState(max_holders_per_block=args.replicas)
        )
    else:
        registry = RedisRegistry(
            hasher.fingerprint,
            redis_url,
            namespace=f"bench-{args.seed}",
            max_holders_per_block=args.replicas,
            publish_timeout_s=30.0,
        )
    await registry.connect()
    gc.collect()
    memory_before = await _redis_used_memory(redis_url) if redis_url else 0
    if redis_url is None:
        tracemalloc.start()

    # Publish: each replica sends its prompts as events, `batch` events per publish call.
    entries = 0
    started = time.perf_counter()
    for replica in replicas:
        batch: list[CacheEvent] = []
        for seq, key in enumerate(keys):
            batch.append(CacheEvent(EventKind.STORED, replica, seq, 1, Tier.GPU, key.block_hashes))
            if len(batch) == args.batch_events:
                results = await registry.publish(batch)
                assert not any(r.failed for r in results), results
                batch = []
        if batch:
            await registry.publish(batch)
        entries += len(keys) * args.blocks
    publish_s = time.perf_counter() - started

    if redis_url is None:
        memory_after, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        version = "-"
    else:
        memory_after = await _redis_used_memory(redis_url)
        version = await _redis_version(redis_url)

    samples: list[float] = []
    for _ in range(args.lookups):
        key = rng.choice(keys)
        t0 = time.perf_counter()
        hits = await registry.lookup(key, replicas, deadline_s=1.0)
        samples.append((time.perf_counter() - t0) * 1000)
        if len(hits) != args.replicas or any(h.num_blocks != args.blocks for h in hits.values()):
            raise RuntimeError("lookup returned a wrong answer; the benchmark is invalid")
    await registry.close()
    return BenchResult(
        backend="memory" if redis_url is None else "redis",
        replicas=args.replicas,
        blocks=args.blocks,
        prompts=args.prompts,
        lookups=args.lookups,
        block_entries=entries,
        lookup_p50_ms=round(percentile(samples, 0.50), 4),
        lookup_p99_ms=round(percentile(samples, 0.99), 4),
        lookup_mean_ms=round(statistics.fmean(samples), 4),
        publish_blocks_per_s=round(entries / publish_s),
        bytes_per_block_entry=round((memory_after - memory_before) / entries, 1),
        hash_4096_tokens_ms=round(time_hashing(16), 4),
        redis_version=version,
    )


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--backend", choices=["memory", "redis"], default="redis", help="the registry to time"
    )
    parser.add_argument(
        "--redis-url",
        help="an existing Redis server, redis://HOST:PORT (default: none, start a private one "
        "on loopback)",
    )
    parser.add_argument(
        "--replicas", type=int, default=64, help="replicas, each holding every prompt"
    )
    parser.add_argument("--blocks", type=int, default=64, help="blocks per prompt")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts, all held")
    parser.add_argument("--lookups", type=int, default=2000, help="timed lookups")
    parser.add_argument("--batch-events", type=int, default=16, help="events per publish call")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' tokens")
    parser.add_argument("--json", type=Path, help="write the result here (default: none)")
    return parser.parse_args(argv)


def main(argv: list[str], prog: str = "registry-bench") -> int:
    args = parse_args(argv, prog)
    if args.backend == "memory":
        result = asyncio.run(run_bench(args, None))
    elif args.redis_url:
        result = asyncio.run(run_bench(args, args.redis_url))
    else:
        with LocalRedisServer() as server:
            result = asyncio.run(run_bench(args, server.url))
    width = max(len(k) for k in asdict(result))
    for name, value in asdict(result).items():
        print(f"{name:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0
