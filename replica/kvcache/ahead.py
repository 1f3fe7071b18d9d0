"""The connector's promotions ahead of need, scheduler side (pure: no vLLM, no I/O): the
requests waiting in vLLM's queue, oldest first, and which of their disk and shared-folder
blocks to promote into the CPU tier while no load is queued (``TierPlanner.prefetch``).

While a prefill spends every step's token budget, vLLM looks at no waiting request and the
loader would idle (Strata: neither the transfer queue nor the compute should idle while the
other is the bottleneck). Promotions go out in batches of at most ``PREFETCH_BATCH`` blocks,
so a request's load that comes meanwhile waits behind no more than one on the loader, until
``bound`` blocks are on their way. The workers report each batch back (``worker_report.py``),
counted over the tensor-parallel ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.planner import TierPlanner
from prefixmesh.replica.kvcache.policy.base import chain_refs
from prefixmesh.replica.kvcache.worker_report import PrefetchReport, PrefetchTally

PREFETCH_BATCH = 64
"""Blocks one promotion reads at most."""
PREFETCH_LOOKAHEAD = 16
"""Waiting requests looked at for blocks to promote, oldest first."""


@dataclass(frozen=True, slots=True)
class WaitingPrompt:
    request_id: str
    blocks: Sequence[BlockHash]
    """Its prompt's full blocks (chained hashes)."""
    usable: int
    """How many of them a cache may serve (vLLM computes at least the last prompt token)."""


class AheadOfNeed:
    def __init__(self, planner: TierPlanner, bound: int, ranks: int) -> None:
        """``bound``: blocks on their way at most (0: never promote); ``ranks``: the workers
        that report each batch."""
        self._planner = planner
        self._bound = bound
        self._tally = PrefetchTally(ranks)
        self._waiting: dict[str, WaitingPrompt] = {}

    def waiting(self, prompt: WaitingPrompt) -> None:
        """It joined vLLM's waiting queue."""
        self._waiting[prompt.request_id] = prompt

    def left(self, request_id: str) -> None:
        """It left the queue (scheduled, or gone): what was kept for it may go again."""
        self._waiting.pop(request_id, None)
        self._planner.release(request_id)

    def plan(self) -> None:
        """This step's promotions, if no load is queued and there is room."""
        planner = self._planner
        room = self._bound - planner.prefetching
        if room <= 0 or planner.backlog_s > 0 or not self._waiting:
            return
        for prompt in itertools.islice(self._waiting.values(), PREFETCH_LOOKAHEAD):
            refs = chain_refs(prompt.blocks[: prompt.usable])
            while room > 0 and (
                planned := planner.prefetch(prompt.request_id, refs, min(PREFETCH_BATCH, room))
            ):
                room -= planned
            if room <= 0:
                return

    def reported(self, report: PrefetchReport) -> None:
        """The workers' reports of this step: the batches every rank ran are done."""
        for batch, failed in self._tally.add(report):
            self._planner.prefetched(batch, failed)
