"""What travels between the router (router/) and the replicas (replica/), and nothing else: the
request a replica serves (``GenerateRequest``, with its ``SamplingSettings`` and hold), the
chunks it streams back (``GenerateChunk``), a load-balanced routing call (``LoadBalanced``), a
replica's load (``ReplicaReport``, ``replica_report``), its requests' progress
(``request_progress``) and the direct path's decision as trusted headers (``route_ticket``).
The OpenAI API the servers speak is ``prefixmesh/api/``, which builds on this package.

Both packages import this package and never each other. The routing decision travels as one
``RouteTicket`` (``route_ticket``): on the proxy path in ``GenerateRequest.ticket`` of the
replica call's argument (the request router's Serve adapter swaps in the request carrying it),
on the direct path as trusted headers. A request carries its prompt's ``PrefixKey`` as the
hasher made it; a claim the router took never travels (its ledger releases it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.wire.replica_report import ReplicaCapacity as ReplicaCapacity
from prefixmesh.wire.replica_report import ReplicaCounters as ReplicaCounters
from prefixmesh.wire.replica_report import ReplicaReport as ReplicaReport
from prefixmesh.wire.route_ticket import Hold as Hold
from prefixmesh.wire.route_ticket import RouteTicket as RouteTicket


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    """Choices to generate (``replica/engines/choices.py`` fans them out)."""
    top_k: int = 0
    """0: every token (vLLM's ``-1`` and ``0``)."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    key: PrefixKey
    """The chained hashes of the prompt's full blocks, as the hasher made them (what the
    replica publishes, too)."""
    sampling: SamplingSettings
    ticket: RouteTicket | None = None
    """The routing decision (its replica, reason, matched blocks and hold): None until the
    request router decided. On the proxy path the request router's Serve adapter sends the
    replica a copy of the request carrying it; the caller's own request never changes."""
    avoid_replicas: tuple[str, ...] = ()
    """Replicas a retry must not go back to (they failed this request); the request router
    ignores it when it would leave no candidate."""
    trace_context: Mapping[str, str] | None = None
    """W3C trace context (``traceparent``, ``tracestate``) of the span the next hop's spans are
    children of: the ingress sets its request span's, the request router's copy for the
    replica carries its routing decision's instead, the replica parents its spans on it. It
    travels inside the pickled handle call (Serve carries no context of its own). None when
    tracing is off."""
    tenant: str = "anonymous"
    """The tenant the request's API key names (fair share and quotas count by it)."""
    priority: int = 0
    """Lower starts first when the replica is saturated (vLLM's ``priority``)."""

    @property
    def hold(self) -> Hold | None:
        """The hold the routing decision asks for (None: none, or not routed)."""
        return self.ticket.hold if self.ticket is not None else None

    @property
    def prompt(self) -> str:
        """The prompt as text, one character per token (code point 0x10000 + id), for request
        routers that match text prefixes: Ray Serve LLM's PrefixCacheAffinityRouter reads the
        ``prompt`` attribute of a request argument. Token and character prefixes coincide."""
        return "".join([chr(0x10000 + t % 0xF0000) for t in self.prompt_token_ids])


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    replica_id: str = ""
    held_s: float = 0.0
    """Time the request waited in a delay-hit hold before entering the engine."""
    index: int = 0
    """The choice these tokens belong to (``SamplingSettings.n``)."""


@dataclass(frozen=True, slots=True)
class LoadBalanced:
    """A routing call without a prompt to key (the direct path's router could not read the
    body, or ran out of time): the request router picks on load alone."""
