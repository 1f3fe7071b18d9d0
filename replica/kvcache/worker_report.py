"""What the connector's workers tell its scheduler side each step beyond finished loads: the
promotions ahead of need they ran (vLLM's ``KVConnectorWorkerMetadata``, added up over the
ranks before the scheduler sees it).

Every tensor-parallel rank promotes its own shard of a block, so a promotion is done only once
every rank has reported it; a block that failed on any rank failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from prefixmesh.cache_registry.types import BlockHash


@dataclass
class PrefetchReport(KVConnectorWorkerMetadata):
    """Promotion batch -> (ranks that ran it, blocks that failed on any of them)."""

    batches: dict[int, tuple[int, frozenset[BlockHash]]] = field(default_factory=dict)

    @classmethod
    def of_rank(cls, prefetched: Mapping[int, Sequence[BlockHash]]) -> PrefetchReport:
        return cls({batch: (1, frozenset(failed)) for batch, failed in prefetched.items()})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PrefetchReport:
        if not isinstance(other, PrefetchReport):
            return self
        merged = dict(self.batches)
        for batch, (ranks, failed) in other.batches.items():
            have_ranks, have_failed = merged.get(batch, (0, frozenset()))
            merged[batch] = (have_ranks + ranks, have_failed | failed)
        return PrefetchReport(merged)


class PrefetchTally:
    """The scheduler side's count of each promotion's reports until every rank's is in (a rank
    may report a batch a step later than another)."""

    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._seen = PrefetchReport()

    def add(self, report: PrefetchReport) -> list[tuple[int, frozenset[BlockHash]]]:
        """The batches every rank has now run, each with the blocks that failed."""
        seen = self._seen.aggregate(report).batches
        complete = [
            (batch, failed) for batch, (ranks, failed) in seen.items() if ranks >= self._ranks
        ]
        for batch, _ in complete:
            del seen[batch]
        self._seen = PrefetchReport(seen)
        return complete
