"""A replica's load report: what it tells the routers (and tests and benchmarks) about itself.

The replica builds a ``ReplicaReport``; Ray Serve polls it (``record_routing_stats``) and hands
it to the request router as a plain dict, so ``to_wire``/``from_wire`` are the one place where
the report becomes a dict and back. ``from_wire`` never raises: a missing or garbled field reads
as its default (a capacity that cannot be read, as none: the router then assumes its configured
one). The cluster simulator's fleet builds the same report from its engine model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any


def extra_attention_pairs(prompt_tokens: int, uncached: int, max_batch_tokens: int) -> float:
    """The query-key pairs of computing the last ``uncached`` (u) of ``prompt_tokens`` (P)
    that a prefill rate measured on ``max_batch_tokens``-sized (B) chunks at zero context does
    not count: u * (P - u / 2) in all, u * B / 2 counted (never below 0)."""
    if uncached <= 0:
        return 0.0
    pairs = uncached * (prompt_tokens - 0.5 * uncached - 0.5 * max_batch_tokens)
    return pairs if pairs > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """What one replica (one data-parallel rank, possibly tensor-parallel) can do.

    Per replica, not per GPU: a TP-4 replica reports the prefill rate of its four GPUs together.
    """

    prefill_tokens_per_s: float
    """Uncached prompt tokens it prefills per second when busy (long-prompt regime)."""
    decode_step_s: float
    """Time of one decode step at a small batch: the inter-token latency floor."""
    max_batch_tokens: int
    """Per-step token budget of its scheduler (chunked prefill + decode tokens)."""
    kv_blocks: int
    """Engine-tier KV cache capacity in blocks."""
    tp_degree: int = 1
    cpu_load_s_per_block: float = 0.0
    """Time to bring one block back from its CPU tier (0 when it has none)."""
    disk_load_s_per_block: float = 0.0
    shared_load_s_per_block: float = 0.0
    """Time to bring one block from the cluster's shared tier (0 when it reads none)."""
    kv_read_s_per_block: float = 0.0
    """Step time added per KV block its running requests hold: decode attention reads every
    one of them each step (KV bytes per block / memory bandwidth). 0 when unknown: then a busy
    replica's decode steps are estimated from its running requests' compute alone."""
    attn_s_per_token_pair: float = 0.0
    """Prefill attention's compute per (query token, context token) pair. Computing a prompt's
    last u of P tokens attends to u * (P - u / 2) pairs, of which ``prefill_tokens_per_s``
    (budget-sized chunks at zero context) already counts u * max_batch_tokens / 2; the rest
    matters on long prompts (a 191k-token prompt takes ~4x its linear estimate on an H100).
    0 when unknown: a prefill is then estimated linear in its tokens."""

    def __post_init__(self) -> None:
        # At least one block: shares of it are taken (a replica reports 0 before it knows).
        if self.kv_blocks < 1:
            object.__setattr__(self, "kv_blocks", 1)

    def usable(self) -> bool:
        """Whether every time and rate is a finite number (a measurement that divided by
        zero is not)."""
        return all(math.isfinite(getattr(self, f.name)) for f in fields(self) if f.type == "float")

    def prefill_attention_s(self, prompt_tokens: int, uncached: int) -> float:
        """Prefill attention beyond the linear rate (``extra_attention_pairs`` at this
        replica's cost per pair; 0 when it reports none)."""
        per_pair = self.attn_s_per_token_pair
        if per_pair <= 0:
            return 0.0
        return per_pair * extra_attention_pairs(prompt_tokens, uncached, self.max_batch_tokens)

    def to_wire(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, raw: object) -> ReplicaCapacity | None:
        """The capacity in ``raw`` (an engine's ``capacity()``, or a report's), None if any
        of the four fields without a default is missing or unreadable."""
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls(
                prefill_tokens_per_s=_finite(raw["prefill_tokens_per_s"]),
                decode_step_s=_finite(raw["decode_step_s"]),
                max_batch_tokens=int(raw["max_batch_tokens"]),
                kv_blocks=int(raw["kv_blocks"]),
                tp_degree=int(raw.get("tp_degree", 1)),
                cpu_load_s_per_block=_finite(raw.get("cpu_load_s_per_block", 0.0)),
                disk_load_s_per_block=_finite(raw.get("disk_load_s_per_block", 0.0)),
                shared_load_s_per_block=_finite(raw.get("shared_load_s_per_block", 0.0)),
                kv_read_s_per_block=_finite(raw.get("kv_read_s_per_block", 0.0)),
                attn_s_per_token_pair=_finite(raw.get("attn_s_per_token_pair", 0.0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """What a replica counts, for tests, benchmarks and operators (the routers read none)."""

    epoch: int = 0
    """The replica's cache-event epoch."""
    engine_running_requests: int = 0
    engine_waiting_requests: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    external_prefix_cache_hit_tokens: int = 0
    """Prompt tokens loaded from the lower tiers by our KV connector."""
    layer_loads: int = 0
    """Requests whose CPU-tier blocks the connector loaded inside their step, layer by layer."""
    async_loads: int = 0
    """Requests whose blocks the connector loaded beside the engine's steps."""
    holds: int = 0
    """Requests that waited in a delay-hit hold here."""
    hold_timeouts: int = 0
    published_events: int = 0
    published_resets: int = 0
    """Acknowledged events that replaced the replica's whole view in the registry (a cleared
    cache, a new epoch)."""
    resyncs: int = 0
    heartbeat_mismatches: int = 0
    reaped_replicas: int = 0
    event_gaps: int = 0
    fair_share_waits: int = 0
    """Requests that waited for the fair-share gate (the replica was saturated)."""
    fair_share_waiting: int = 0
    """Requests waiting for it now."""


NO_COUNTERS = ReplicaCounters()


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's load for routing, and its counters."""

    queued_requests: int = 0
    """Accepted, not yet running (held requests included)."""
    running_requests: int = 0
    pending_prefill_tokens: int = 0
    """Prompt tokens of the queued requests (what it still has to prefill)."""
    pending_attention_s: float = 0.0
    """What their attention adds to that at its own cost (``prefill_attention_s`` of each
    request's tokens still to compute; 0 when it reports no attention cost): a replica deep in
    a long prompt is busier than its token count says."""
    kv_usage: float = 0.0
    """Fraction of the engine-tier KV cache in use."""
    capacity: ReplicaCapacity | None = None
    """None: not reported (the router assumes its configured capacity)."""
    seen_requests: tuple[str, ...] = ()
    """Requests queued, running or recently finished here: routers that send requests past
    Serve's handle (the direct path) learn from it which of theirs arrived."""
    counters: ReplicaCounters = NO_COUNTERS
    """Flat beside the load on the wire."""

    @property
    def ongoing_requests(self) -> int:
        return self.queued_requests + self.running_requests

    def active_kv_blocks(self, capacity: ReplicaCapacity) -> int:
        """KV blocks its running requests hold, at ``capacity`` (rounded: a fraction of the
        blocks sent as a float comes back as the same count)."""
        return round(self.kv_usage * capacity.kv_blocks)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {name: getattr(self, name) for name in _LOAD}
        wire.update((name, getattr(self.counters, name)) for name in _COUNTERS)
        if self.capacity is not None:
            wire["capacity"] = self.capacity.to_wire()
        wire["seen_requests"] = list(self.seen_requests)
        return wire

    @classmethod
    def from_wire(cls, raw: object) -> ReplicaReport:
        """The report in ``raw`` (Serve's copy of ``to_wire``'s dict; {} before the first)."""
        if not isinstance(raw, Mapping):
            return cls()
        seen = raw.get("seen_requests")
        return cls(
            capacity=ReplicaCapacity.from_wire(raw.get("capacity")),
            seen_requests=tuple(seen) if isinstance(seen, list | tuple) else (),
            counters=ReplicaCounters(**_numbers(raw, _COUNTERS)),
            **_numbers(raw, _LOAD),
        )


Reader = Callable[[Any], float]


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


def _numbers(raw: Mapping[Any, Any], kinds: Mapping[str, Reader]) -> dict[str, Any]:
    """The fields of ``kinds`` that ``raw`` holds readably (the rest keep their defaults)."""
    values: dict[str, Any] = {}
    for name, kind in kinds.items():
        value = raw.get(name)
        if value is not None:
            with contextlib.suppress(TypeError, ValueError, OverflowError):  # garbled: default
                values[name] = kind(value)
    return values


_LOAD: dict[str, Reader] = {
    "queued_requests": int,
    "running_requests": int,
    "pending_prefill_tokens": int,
    "pending_attention_s": _finite,
    "kv_usage": _finite,
}
_COUNTERS: dict[str, Reader] = {f.name: int for f in fields(ReplicaCounters)}
"""The wire's flat numeric keys and how each is read."""
