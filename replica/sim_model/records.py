"""What goes into and comes out of the engine model (``engine.py``): requests, each request's
record, the events it emits and the load it reports. A request's hold is the router's own
``Hold`` (``prefixmesh.wire``); the real engines' request and load are ``EngineRequest`` and
``EngineLoad`` (``replica/engines/base.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.replica.sim_model.prefix_cache import CacheChange


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A request as the engine model sees it: its key and token counts (the real engines take
    ``EngineRequest``, token ids and sampling)."""

    request_id: str
    key: PrefixKey
    """Chained hashes of the prompt's full blocks (block size = the engine's)."""
    prompt_tokens: int
    output_tokens: int
    """Tokens it generates (the first comes from the prefill step)."""
    finish_key: PrefixKey | None = None
    """Key of prompt + answer (extends ``key``): cached at finish, for the session's next turn."""
    priority: int = 0
    """Lower goes first (vLLM's ``priority``); equal priorities go in arrival order."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in the driver's clock)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    """Prompt tokens served from cache at admission (both tiers)."""
    cpu_cached_tokens: int = 0
    """Of those, tokens loaded back from the CPU tier."""
    shared_cached_tokens: int = 0
    """Of those, tokens loaded from the cluster's shared tier."""
    prefill_tokens: int = 0
    """Prompt tokens computed (prompt_tokens - cached_tokens once admitted)."""
    held_s: float = 0.0
    """Time spent held behind an in-flight prefix."""
    aborted: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class CacheChanged:
    time_s: float
    changes: tuple[CacheChange, ...]


@dataclass(frozen=True, slots=True)
class FirstToken:
    time_s: float
    request_id: str


@dataclass(frozen=True, slots=True)
class Finished:
    time_s: float
    record: RequestRecord
    """Complete (or ``aborted``); the engine no longer changes it."""


EngineEvent = CacheChanged | FirstToken | Finished


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """What a replica reports about its load (the router's snapshot fields)."""

    queued_requests: int
    running_requests: int
    pending_prefill_tokens: int
    """Prompt tokens still to compute: in progress exactly, waiting ones estimated from this
    engine's cache when they were submitted."""
    active_kv_blocks: int
    """Blocks reserved by running requests (prompt and output)."""
    pending_attention_s: float = 0.0
    """What their attention costs beyond the linear prefill rate (``extra_attention_pairs``)."""
