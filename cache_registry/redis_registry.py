"""The Redis backend of ``CacheRegistry`` (async ``redis`` client, Lua scripts, pub/sub).

The server is a ``RedisEndpoint`` (URL, password, TLS); a bare URL works too. Every operation
is one pipelined round trip under a time budget. A failure or a timeout returns "nothing
known", counts in ``stats`` (with a password-free diagnosis in ``health``), and puts the client
in a short, growing backoff during which calls return at once; the first success after it
counts a reconnect and re-checks the fingerprint (a restarted Redis has lost it, and every
entry with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from prefixmesh.cache_registry import redis_scripts
from prefixmesh.cache_registry.hashing import CacheFingerprint, FingerprintMismatchError
from prefixmesh.cache_registry.hotness import DecayedCount, rate_per_s
from prefixmesh.cache_registry.protocol import group_by_replica
from prefixmesh.cache_registry.redis_connection import RedisEndpoint
from prefixmesh.cache_registry.registry_health import (
    HEALTHY,
    RegistryHealth,
    diagnose,
    fingerprint_mismatch,
)
from prefixmesh.cache_registry.sequencing import MAX_EPOCH
from prefixmesh.cache_registry.types import (
    DROPPED_REPLICA_MEMORY_S,
    BlockHash,
    CacheEvent,
    EventKind,
    PrefixHit,
    PrefixKey,
    PublishResult,
    RegistryStats,
    ReplicaId,
)
from prefixmesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
T = TypeVar("T")
_EVENT_CODES = {EventKind.STORED: "s", EventKind.REMOVED: "r", EventKind.CLEARED: "c"}
_FAILURES = (RedisError, OSError, TimeoutError)
_ScriptArg = str | int
"""One argument of a Lua script call (Redis sends each as a string)."""
# Both clients decode replies (``decode_responses=True``): a reply is a ``str``, never the
# ``bytes`` redis-py's annotations allow, hence the ``cast``s below.

_DEADLINE_MISSES_BEFORE_OUTAGE = 3
"""Missed deadlines in a row that count as an outage (back off, re-check the fingerprint).
One miss is usually a busy machine or a long script, not a dead server: treating it as an
outage blinded every routing decision for the back-off and the re-check (50+ ms) after a
single slow lookup during a burst. A stalled server misses every deadline and is caught by the
third."""


def hex_hash(block: BlockHash) -> str:
    return f"{block:016x}"


class RedisRegistry:
    """``CacheRegistry`` over one Redis server (or one shard: all keys share a hash tag)."""

    def __init__(
        self,
        fingerprint: CacheFingerprint,
        url: str | RedisEndpoint,
        *,
        namespace: str = "prefixmesh",
        clock: Callable[[], float] = time.time,
        max_holders_per_block: int = 64,
        hotness_half_life_s: float = 30.0,
        op_timeout_s: float = 0.25,
        publish_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 1.0,
        release_poll_s: float = 0.05,
    ) -> None:
        if max_holders_per_block < 1:
            raise ValueError("max_holders_per_block must be >= 1")
        self.fingerprint = fingerprint
        self.stats = RegistryStats()
        self.endpoint = url if isinstance(url, RedisEndpoint) else RedisEndpoint.of(url)
        self._namespace = namespace
        self._prefix = "{" + namespace + "}"
        self._clock = clock
        self._max_holders = max_holders_per_block
        self._half_life_s = hotness_half_life_s
        self._op_timeout_s = op_timeout_s
        self._publish_timeout_s = publish_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._release_poll_s = release_poll_s
        # No client-side retries: the time budget and the backoff below replace them.
        self._redis: aioredis.Redis = self.endpoint.async_client(
            socket_connect_timeout=op_timeout_s,
            socket_timeout=publish_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        # Pub/sub waits idle for long stretches: its own client, with no read timeout.
        self._pubsub_redis: aioredis.Redis = self.endpoint.async_client(
            socket_connect_timeout=op_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._scripts = {
            name: self._redis.register_script(getattr(redis_scripts, name))
            for name in (
                "PUBLISH",
                "LOOKUP",
                "ADD_SPECULATIVE",
                "CLAIM",
                "RELEASE",
                "DROP_REPLICA",
                "HEARTBEAT",
                "REAP",
                "TOUCH",
            )
        }
        self._failing = False
        self._deadline_misses = 0
        self._backoff_s = backoff_initial_s
        self._retry_at = 0.0
        self._verified = False
        self._disabled_reason = ""
        self._failure = HEALTHY
        """What the latest failure said about the registry (``HEALTHY`` once it answers)."""
        self._waiters: dict[BlockHash, asyncio.Event] = {}
        self._listener: asyncio.Task[None] | None = None
        self._verifying: asyncio.Task[None] | None = None
        self._closing = False

    # ---- connection health -----------------------------------------------------------------

    async def connect(self) -> None:
        try:
            await asyncio.wait_for(self._check_fingerprint(), self._op_timeout_s * 4)
        except _FAILURES as exc:
            self._on_failure(exc)
            logger.warning(
                "registry degraded at connect: %s; routing goes on without it and retries",
                self._failure.message,
            )
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen_releases())

    async def close(self) -> None:
        self._closing = True
        if self._verifying is not None and not self._verifying.done():
            await cancel_and_wait(self._verifying)
        if self._listener is not None:
            try:
                await asyncio.wait_for(self._listener, 2.0)
            except (TimeoutError, *_FAILURES):
                self._listener.cancel()
            self._listener = None
        await self._redis.aclose()
        await self._pubsub_redis.aclose()

    async def _check_fingerprint(self) -> None:
        key = f"{self._prefix}:fp"
        mine = self.fingerprint.to_json()
        await self._redis.set(key, mine, nx=True)
        stored = cast("str | None", await self._redis.get(key))
        if stored is not None and stored != mine:
            mismatch = fingerprint_mismatch(
                self.endpoint, self._namespace, stored, self.fingerprint
            )
            raise FingerprintMismatchError(mismatch.message)
        self._verified = True

    def _on_failure(self, exc: BaseException) -> None:
        self._failure = diagnose(exc, self.endpoint)
        self.stats.last_error = self._failure.message
        now = time.monotonic()
        if self._failing:
            self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        else:
            logger.warning(
                "registry call failed (%s); degrading to no cache knowledge", self._failure.message
            )
            self._failing = True
            self._verified = False
        self._retry_at = now + self._backoff_s

    async def _on_success(self) -> None:
        if self._failing:
            self._failing = False
            self._failure = HEALTHY
            self._backoff_s = self._backoff_initial_s
            self.stats.reconnects += 1
            logger.info("registry reachable again")
        if not self._verified and (self._verifying is None or self._verifying.done()):
            # Off the caller's path: a lookup must keep its deadline even right after the
            # registry came back (the check takes a round trip or two, up to op_timeout_s).
            self._verifying = asyncio.get_running_loop().create_task(self._verify())

    async def _verify(self) -> None:
        """Re-check the fingerprint after an outage: a restarted Redis may now hold another
        cluster's keys (or none: then ours is written)."""
        try:
            await asyncio.wait_for(self._check_fingerprint(), self._op_timeout_s)
        except FingerprintMismatchError as exc:
            self._disabled_reason = str(exc)
            logger.error("registry disabled: %s", exc)
        except _FAILURES as exc:
            self._on_failure(exc)

    @property
    def verified(self) -> bool:
        """The fingerprint check has passed since the last outage: results are trusted."""
        return self._verified and not self._disabled_reason

    @property
    def health(self) -> RegistryHealth:
        """What this client knows: a fingerprint mismatch, its latest failure while it lasts,
        else healthy (it learns only from its own calls; ``RedisProbe`` asks)."""
        if self._disabled_reason:
            return RegistryHealth("fingerprint", self._disabled_reason)
        return self._failure if self._failing else HEALTHY

    @property
    def available(self) -> bool:
        """False while backing off after a failure, or after a fingerprint mismatch."""
        return not self._disabled_reason and time.monotonic() >= self._retry_at

    async def _guarded(
        self, call: Callable[[], Awaitable[T]], default: T, timeout_s: float
    ) -> tuple[T, bool]:
        """Run ``call`` under the time budget; (result, True) or (default, False)."""
        if not self.available:
            return default, False
        try:
            result = await asyncio.wait_for(call(), timeout_s)
        except TimeoutError as exc:
            self.stats.last_error = f"{type(exc).__name__}: deadline of {timeout_s:.3f} s missed"
            self._deadline_misses += 1
            if self._failing or self._deadline_misses >= _DEADLINE_MISSES_BEFORE_OUTAGE:
                self._on_failure(exc)
            return default, False
        except _FAILURES as exc:
            self._on_failure(exc)
            return default, False
        self._deadline_misses = 0
        await self._on_success()
        if self._disabled_reason or not self._verified:
            return default, False  # not trusted until the fingerprint check has passed
        return result, True

    def _key(self, kind: str, suffix: str) -> str:
        return f"{self._prefix}:{kind}:{suffix}"

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # ---- lookups ---------------------------------------------------------------------------

    async def lookup(
        self, key: PrefixKey, replicas: Collection[ReplicaId], *, deadline_s: float
    ) -> dict[ReplicaId, PrefixHit]:
        self.stats.lookups += 1
        if not key.block_hashes:
            return {}
        args: list[_ScriptArg] = [
            self._prefix,
            self._now_ms(),
            "".join(hex_hash(b) for b in key.block_hashes),
            "\n".join(replicas),
        ]
        text, ok = await self._guarded(lambda: self._scripts["LOOKUP"](args=args), "", deadline_s)
        if not ok:
            self.stats.lookup_failures += 1
            return {}
        hits: dict[ReplicaId, PrefixHit] = {}
        shared: dict[str, PrefixHit] = {}  # replicas with equal rows share one value
        for line in text.splitlines():
            name, _, row = line.partition(" ")
            hit = shared.get(row)
            if hit is None:
                gpu, cpu, disk, speculative = (int(x) for x in row.split())
                hit = shared[row] = PrefixHit(gpu + cpu + disk, (gpu, cpu, disk), speculative)
            hits[ReplicaId(name)] = hit
        return hits

    # ---- events ----------------------------------------------------------------------------

    async def publish(self, events: Sequence[CacheEvent]) -> list[PublishResult]:
        grouped = group_by_replica(events)
        if not grouped:
            return []
        for event in events:
            if not 0 <= event.epoch <= MAX_EPOCH:
                raise ValueError(f"epoch must be in [0, 2**53), got {event.epoch}")

        now_ms = self._now_ms()

        async def run() -> list[list[int]]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for replica, batch in grouped.items():
                    args: list[_ScriptArg] = [self._prefix, replica, self._max_holders, now_ms]
                    for event in batch:
                        tier = -1 if event.tier is None else int(event.tier)
                        args += [
                            _EVENT_CODES[event.kind],
                            event.epoch,
                            event.seq,
                            tier,
                            len(event.block_hashes),
                        ]
                        args += [hex_hash(b) for b in event.block_hashes]
                    await self._scripts["PUBLISH"](args=args, client=pipe)
                return list(await pipe.execute())  # each PUBLISH's {applied, dups, gap, reset}

        none_applied: list[list[int]] = []
        replies, ok = await self._guarded(run, none_applied, self._publish_timeout_s)
        if not ok:
            self.stats.publish_failures += 1
            return [PublishResult(replica, 0, failed=True) for replica in grouped]
        return [
            PublishResult(replica, int(a), int(d), bool(int(g)), bool(int(r)))
            for replica, (a, d, g, r) in zip(grouped, replies, strict=True)
        ]

    async def add_speculative(self, key: PrefixKey, replica: ReplicaId, ttl_s: float) -> None:
        if not key.block_hashes:
            return
        now_ms = self._now_ms()
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        args: list[_ScriptArg] = [self._prefix, replica, now_ms + ttl_ms, ttl_ms, now_ms]
        args += [hex_hash(b) for b in key.block_hashes]
        _, ok = await self._guarded(
            lambda: self._scripts["ADD_SPECULATIVE"](args=args), None, self._op_timeout_s
        )
        if not ok:
            self.stats.other_failures += 1

    # ---- in-flight claims ------------------------------------------------------------------

    async def claim_inflight(
        self, prefix: BlockHash, replica: ReplicaId, ttl_s: float
    ) -> ReplicaId | None:
        args: list[_ScriptArg] = [
            self._prefix,
            hex_hash(prefix),
            replica,
            max(1, math.ceil(ttl_s * 1000)),
        ]
        holder, ok = await self._guarded(
            lambda: cast("Awaitable[str | None]", self._scripts["CLAIM"](args=args)),
            None,
            self._op_timeout_s,
        )
        if not ok:
            self.stats.other_failures += 1
        return ReplicaId(holder) if holder else None

    async def inflight(self, prefix: BlockHash) -> ReplicaId | None:
        holder, ok = await self._guarded(
            lambda: cast(
                "Awaitable[str | None]", self._redis.get(self._key("if", hex_hash(prefix)))
            ),
            None,
            self._op_timeout_s,
        )
        if not ok:
            self.stats.other_failures += 1
        return ReplicaId(holder) if holder else None

    async def release_inflight(self, prefix: BlockHash, replica: ReplicaId) -> bool:
        args = [self._prefix, hex_hash(prefix), replica]
        released, ok = await self._guarded(
            lambda: self._scripts["RELEASE"](args=args), 0, self._op_timeout_s
        )
        if not ok:
            self.stats.other_failures += 1
        return bool(released)

    async def wait_released(self, prefix: BlockHash, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            event = self._waiters.setdefault(prefix, asyncio.Event())
            holder, ok = await self._guarded(
                lambda: self._redis.get(self._key("if", hex_hash(prefix))),
                None,
                self._op_timeout_s,
            )
            if not ok:
                self.stats.other_failures += 1
                return False
            if holder is None:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # The pub/sub listener wakes us on release; polling covers a lost message.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, self._release_poll_s))

    async def _listen_releases(self) -> None:
        channel = f"{self._prefix}:released"
        while not self._closing:
            pubsub = self._pubsub_redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                while not self._closing:
                    # A bounded wait, so that close() never waits on a blocked read.
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if message is None or message.get("type") != "message":
                        continue
                    event = self._waiters.pop(BlockHash(int(message["data"], 16)), None)
                    if event is not None:
                        event.set()
            except _FAILURES:
                await asyncio.sleep(self._backoff_max_s)
            finally:
                with contextlib.suppress(*_FAILURES):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py

    # ---- hotness ---------------------------------------------------------------------------

    async def touch(self, group: BlockHash, weight: float = 1.0) -> None:
        # Keep a counter for 20 half-lives: by then it has decayed below 1e-6 of its value.
        ttl_ms = math.ceil(self._half_life_s * 20 * 1000)
        args: list[_ScriptArg] = [
            self._prefix,
            hex_hash(group),
            repr(float(weight)),
            repr(self._clock()),
            repr(self._half_life_s),
            ttl_ms,
        ]
        _, ok = await self._guarded(
            lambda: self._scripts["TOUCH"](args=args), None, self._op_timeout_s
        )
        if not ok:
            self.stats.other_failures += 1

    async def rate(self, group: BlockHash) -> float:
        nothing: list[str | None] = [None, None]
        fields, ok = await self._guarded(
            lambda: cast(
                "Awaitable[list[str | None]]",
                self._redis.hmget(self._key("hot", hex_hash(group)), ["v", "t"]),
            ),
            nothing,
            self._op_timeout_s,
        )
        if not ok:
            self.stats.other_failures += 1
        value, stamp = fields
        if value is None or stamp is None:  # TOUCH sets both fields at once: both or neither
            return 0.0
        count = DecayedCount(float(value), float(stamp))
        return rate_per_s(count, self._clock(), self._half_life_s)

    # ---- membership ------------------------------------------------------------------------

    async def drop_replica(self, replica: ReplicaId) -> None:
        memory_ms = int(DROPPED_REPLICA_MEMORY_S * 1000)
        _, ok = await self._guarded(
            lambda: self._scripts["DROP_REPLICA"](args=[self._prefix, replica, memory_ms]),
            None,
            self._publish_timeout_s,
        )
        if not ok:
            self.stats.other_failures += 1

    async def heartbeat(self, replica: ReplicaId, epoch: int, seq: int) -> bool | None:
        args: list[_ScriptArg] = [self._prefix, replica, epoch, seq, self._now_ms()]
        matched, ok = await self._guarded(
            lambda: self._scripts["HEARTBEAT"](args=args), 0, self._op_timeout_s
        )
        if not ok:
            self.stats.other_failures += 1
            return None
        return bool(matched)

    async def reap(self, dead_after_s: float) -> list[ReplicaId]:
        cutoff_ms = self._now_ms() - math.ceil(dead_after_s * 1000)
        memory_ms = int(DROPPED_REPLICA_MEMORY_S * 1000)
        nobody: list[str] = []
        names, ok = await self._guarded(
            lambda: self._scripts["REAP"](args=[self._prefix, cutoff_ms, memory_ms]),
            nobody,
            self._publish_timeout_s,
        )
        if not ok:
            self.stats.other_failures += 1
        return [ReplicaId(n) for n in names]

    async def known_replicas(self) -> set[ReplicaId]:
        nobody: list[str] = []
        names, _ok = await self._guarded(
            lambda: cast("Awaitable[list[str]]", self._redis.hkeys(f"{self._prefix}:seq")),
            nobody,
            self._op_timeout_s,
        )
        return {ReplicaId(n) for n in names}
