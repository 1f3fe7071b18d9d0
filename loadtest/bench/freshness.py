"""``prefixmesh freshness-bench``: how long the registry's view lags what replicas hold.

From a replica's engine storing (or evicting) a block to a router's lookup showing it: the
replica side runs the real ``EventPublisher`` (batching at ``replica.publish_interval_ms``, as
deployed) against the real Redis registry, in its own process, for ``--replicas`` replicas; the
router side, in this process, polls ``lookup`` for each change as a router would see it. Each
replica stores a new prompt every ``1 / --rate`` seconds and evicts the one it stored
``--keep`` changes before. The lag of a change is the first poll that shows it minus the
moment the engine handed it to the publisher (both on the machine's monotonic clock), so it
includes one poll's resolution (``--poll-ms`` plus a lookup's round trip).

Without ``--redis-url`` a private redis-server is started on loopback and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.cache_registry.redis_registry import RedisRegistry
from prefixmesh.cache_registry.types import EventKind, PrefixKey, ReplicaId, Tier
from prefixmesh.cli_help import command_parser
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.replica.engines.base import BlockChange, Residency
from prefixmesh.replica.events.publisher import EventPublisher

_NAMESPACE = "freshness"


@dataclass(frozen=True)
class Plan:
    replicas: int
    changes: int
    """Stores per replica (each after the first ``keep`` also evicts one)."""
    rate: float
    """Stores per second per replica."""
    blocks: int
    keep: int
    seed: int
    publish_interval_s: float

    def keys(self, hasher: BlockHasher, replica: int) -> list[PrefixKey]:
        """The prompts a replica stores, in order (both processes derive the same ones)."""
        rng = random.Random(self.seed * 1_000_003 + replica)
        size = hasher.block_size * self.blocks
        return [
            hasher.hash_tokens([rng.randrange(50_000) for _ in range(size)])
            for _ in range(self.changes)
        ]


@dataclass(frozen=True)
class FreshnessResult:
    replicas: int
    changes_per_replica: int
    rate_per_replica: float
    blocks_per_change: int
    publish_interval_ms: float
    poll_ms: float
    store_p50_ms: float
    store_p99_ms: float
    store_max_ms: float
    evict_p50_ms: float
    evict_p99_ms: float
    evict_max_ms: float
    missed: int
    """Changes the poller never saw within the time limit (counted as failures)."""


def _replica_id(index: int) -> ReplicaId:
    return ReplicaId(f"replica-{index:02d}")


def _hasher() -> BlockHasher:
    return BlockHasher(16, "freshness")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the replica side (a child process) -----------------------------------------------------


def _replica_main(plan: Plan, url: str, start_at: float, out: str) -> None:
    submitted = asyncio.run(_replicas(plan, url, start_at))
    Path(out).write_text(json.dumps(submitted))


async def _replicas(plan: Plan, url: str, start_at: float) -> dict[str, list[float]]:
    hasher = _hasher()
    runs = [_one_replica(plan, url, start_at, hasher, r) for r in range(plan.replicas)]
    times = await asyncio.gather(*runs)
    return {str(r): t for r, t in enumerate(times)}


async def _one_replica(
    plan: Plan, url: str, start_at: float, hasher: BlockHasher, replica: int
) -> list[float]:
    """Stores (and evicts) on schedule; returns when each store was handed to the publisher."""
    keys = plan.keys(hasher, replica)
    registry = RedisRegistry(hasher.fingerprint, url, namespace=_NAMESPACE)
    await registry.connect()
    held: list[PrefixKey] = []
    publisher = EventPublisher(
        _replica_id(replica),
        registry,
        lambda: Residency.of({Tier.GPU: [b for key in held for b in key.block_hashes]}),
        interval_s=plan.publish_interval_s,
        liveness=registry,
    )
    publisher.start()
    submitted: list[float] = []
    # Replicas start a fraction of a period apart, as independent engines would.
    offset = replica / (plan.replicas * plan.rate)
    for n, key in enumerate(keys):
        due = start_at + offset + n / plan.rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        changes = [BlockChange(EventKind.STORED, Tier.GPU, key.block_hashes)]
        held.append(key)
        if n >= plan.keep:
            evicted = keys[n - plan.keep]
            held.remove(evicted)
            changes.append(BlockChange(EventKind.REMOVED, Tier.GPU, evicted.block_hashes))
        submitted.append(time.monotonic())
        publisher.submit(changes)
    await asyncio.sleep(0.5)  # let the last batches go out before stopping
    await publisher.stop()
    await registry.close()
    return submitted


# ---- the router side (this process) ---------------------------------------------------------


async def _observe(
    plan: Plan, url: str, start_at: float, poll_s: float, limit_s: float
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """When each store became visible and each eviction invisible: (replica, n) -> time."""
    hasher = _hasher()
    registry = RedisRegistry(hasher.fingerprint, url, namespace=_NAMESPACE)
    await registry.connect()
    keys = [plan.keys(hasher, r) for r in range(plan.replicas)]
    ids = [_replica_id(r) for r in range(plan.replicas)]
    stored_at: dict[tuple[int, int], float] = {}
    evicted_at: dict[tuple[int, int], float] = {}
    next_store = [0] * plan.replicas
    next_evict = [0] * plan.replicas  # the next store whose eviction is awaited
    deadline = start_at + plan.changes / plan.rate + limit_s
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))

    async def poll_store(r: int, n: int) -> None:
        hit = (await registry.lookup(keys[r][n], [ids[r]], deadline_s=1.0)).get(ids[r])
        if hit is not None and hit.num_blocks >= plan.blocks and not hit.num_speculative:
            stored_at[(r, n)] = time.monotonic()
            next_store[r] = n + 1

    async def poll_evict(r: int, n: int) -> None:
        if ids[r] not in await registry.lookup(keys[r][n], [ids[r]], deadline_s=1.0):
            evicted_at[(r, n)] = time.monotonic()
            next_evict[r] = n + 1

    while time.monotonic() < deadline:
        polls = []
        for r in range(plan.replicas):
            if next_store[r] < plan.changes:
                polls.append(poll_store(r, next_store[r]))
            # A store that was seen and will be evicted: "gone" now means evicted.
            n = next_evict[r]
            if n + plan.keep < plan.changes and n < next_store[r]:
                polls.append(poll_evict(r, n))
        if not polls and all(e + plan.keep >= plan.changes for e in next_evict):
            break
        await asyncio.gather(*polls)
        await asyncio.sleep(poll_s)
    await registry.close()
    return stored_at, evicted_at


async def run(plan: Plan, url: str, poll_s: float, out_dir: Path) -> FreshnessResult:
    out = out_dir / "submitted.json"
    start_at = time.monotonic() + 3.0  # room for the child to import and connect
    child = multiprocessing.get_context("spawn").Process(
        target=_replica_main, args=(plan, url, start_at, str(out)), daemon=True
    )
    child.start()
    try:
        stored_at, evicted_at = await _observe(plan, url, start_at, poll_s, limit_s=5.0)
    finally:
        await asyncio.to_thread(child.join, 30.0)
        if child.is_alive():
            child.terminate()
    if child.exitcode != 0:
        raise RuntimeError(f"the replica process failed (exit code {child.exitcode})")
    submitted = {int(r): times for r, times in json.loads(out.read_text()).items()}
    store_lags, evict_lags = [], []
    missed = 0
    for r in range(plan.replicas):
        for n in range(plan.changes):
            if (r, n) in stored_at:
                store_lags.append((stored_at[(r, n)] - submitted[r][n]) * 1000)
            else:
                missed += 1
            if n + plan.keep < plan.changes:  # evicted at the store of n + keep
                if (r, n) in evicted_at:
                    evict_lags.append((evicted_at[(r, n)] - submitted[r][n + plan.keep]) * 1000)
                else:
                    missed += 1
    return FreshnessResult(
        replicas=plan.replicas,
        changes_per_replica=plan.changes,
        rate_per_replica=plan.rate,
        blocks_per_change=plan.blocks,
        publish_interval_ms=plan.publish_interval_s * 1000,
        poll_ms=poll_s * 1000,
        store_p50_ms=round(_percentile(store_lags, 0.50), 2),
        store_p99_ms=round(_percentile(store_lags, 0.99), 2),
        store_max_ms=round(max(store_lags, default=float("nan")), 2),
        evict_p50_ms=round(_percentile(evict_lags, 0.50), 2),
        evict_p99_ms=round(_percentile(evict_lags, 0.99), 2),
        evict_max_ms=round(max(evict_lags, default=float("nan")), 2),
        missed=missed,
    )


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--replicas", type=int, default=8, help="replica processes publishing changes"
    )
    parser.add_argument("--changes", type=int, default=200, help="stores per replica")
    parser.add_argument("--rate", type=float, default=20.0, help="stores per second, per replica")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per stored prompt")
    parser.add_argument(
        "--keep",
        type=int,
        default=8,
        help="a replica evicts the prompt it stored this many stores before",
    )
    parser.add_argument(
        "--poll-ms", type=float, default=1.0, help="the router side's poll interval, in ms"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' tokens")
    parser.add_argument(
        "--redis-url",
        help="use this Redis server, redis://HOST:PORT (default: none, start one on loopback)",
    )
    parser.add_argument("--json", type=Path, help="also write the result here (default: none)")
    args = parser.parse_args(argv)
    if min(args.replicas, args.changes, args.blocks, args.keep) < 1 or args.rate <= 0:
        parser.error("--replicas, --changes, --blocks, --keep must be >= 1 and --rate > 0")
    return args


def main(argv: list[str], prog: str = "prefixmesh freshness-bench") -> int:
    args = parse_args(argv, prog)
    config = PrefixmeshConfig()
    plan = Plan(
        replicas=args.replicas,
        changes=args.changes,
        rate=args.rate,
        blocks=args.blocks,
        keep=args.keep,
        seed=args.seed,
        publish_interval_s=config.replica.publish_interval_ms / 1000,
    )
    server = None if args.redis_url else LocalRedisServer()
    if server is not None:
        server.start()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    try:
        with tempfile.TemporaryDirectory(prefix="prefixmesh-freshness-") as tmp:
            result = asyncio.run(run(plan, url, args.poll_ms / 1000, Path(tmp)))
    finally:
        if server is not None:
            server.stop()
    print(
        f"registry freshness: {plan.replicas} replicas x {plan.changes} stores of "
        f"{plan.blocks} blocks at {plan.rate:g}/s each, publish every "
        f"{result.publish_interval_ms:g} ms, poll every {result.poll_ms:g} ms"
    )
    print(f"{'change':<8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(
        f"{'store':<8} {result.store_p50_ms:>8} {result.store_p99_ms:>8} {result.store_max_ms:>8}"
    )
    print(
        f"{'evict':<8} {result.evict_p50_ms:>8} {result.evict_p99_ms:>8} {result.evict_max_ms:>8}"
    )
    print(f"missed: {result.missed}")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 1 if result.missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
