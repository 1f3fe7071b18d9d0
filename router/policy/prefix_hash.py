"""SGLang's ``prefix_hash`` policy: a consistent-hash ring keyed on the prompt's first tokens.

SGLang (``prefix_hash.rs``) hashes the first ``prefix_token_count`` (256) tokens with xxh3 and
looks the hash up on a ring of workers. The chained block hash at index
``prefix_tokens // block_size - 1`` already names exactly those tokens, so it is the key here
(rounded down to whole blocks; the last full block when the prompt is shorter). The load check
is SGLang's ``load_ok``: with total load T over n workers, a worker is acceptable iff
``load <= (T + 1) / n * load_factor`` (the +1 counts the incoming request), and any worker is
acceptable when T is 0. If the ring's choice is not acceptable, the least-loaded acceptable
worker (first in order on a tie) takes the request; if none is, the ring's choice keeps it. A
prompt without a full block has nothing to hash: SGLang then falls back to the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.config import PrefixHashConfig
from prefixmesh.router.policy.base import (
    RegistryView,
    ReplicaSnapshot,
    RouteDecision,
    RouteRequest,
)
from prefixmesh.router.policy.load import (
    QuietHooks,
    by_load_after,
    first_least_loaded,
    ongoing_loads,
    require_replicas,
)
from prefixmesh.router.policy.ring import ReplicaRing


class PrefixHashPolicy(QuietHooks):
    name = "prefix_hash"

    def __init__(self, config: PrefixHashConfig, *, block_size: int) -> None:
        self._load_factor = config.load_factor
        self._key_blocks = max(1, config.prefix_tokens // block_size)
        self._ring = ReplicaRing()

    def ring_key(self, request: RouteRequest) -> BlockHash | None:
        hashes = request.key.block_hashes
        if not hashes:
            return None
        return hashes[min(self._key_blocks, len(hashes)) - 1]

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaSnapshot],
        view: RegistryView,
        now_s: float,
    ) -> RouteDecision:
        require_replicas(replicas, self.name)
        loads = ongoing_loads(replicas)
        key = self.ring_key(request)
        if key is None:
            least = first_least_loaded(loads)
            return RouteDecision(by_load_after(least, replicas, loads), reason="no_tokens")
        self._ring.sync([s.replica_id for s in replicas])
        owner = self._ring.first(key)
        chosen = next(i for i, s in enumerate(replicas) if s.replica_id == owner)
        total = sum(loads)
        limit = (total + 1) / len(replicas) * self._load_factor
        if total == 0 or loads[chosen] <= limit:
            return RouteDecision(by_load_after(chosen, replicas, loads), reason="ring")
        acceptable = [i for i, load in enumerate(loads) if load <= limit]
        if acceptable:
            chosen = first_least_loaded(loads, acceptable)
        return RouteDecision(by_load_after(chosen, replicas, loads), reason="load_factor")
