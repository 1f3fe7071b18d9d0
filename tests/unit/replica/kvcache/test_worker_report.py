"""The workers' promotion reports: added up over ranks, done once every rank reported."""

from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.worker_report import PrefetchReport, PrefetchTally

B = BlockHash


def test_reports_of_the_ranks_add_up_and_a_block_failed_on_any_rank_failed() -> None:
    rank0 = PrefetchReport.of_rank({0: [], 1: [B(5)]})
    rank1 = PrefetchReport.of_rank({0: [B(2)]})
    merged = rank0.aggregate(rank1)
    assert merged.batches == {0: (2, frozenset({B(2)})), 1: (1, frozenset({B(5)}))}
    tally = PrefetchTally(ranks=2)
    assert tally.add(merged) == [(0, frozenset({B(2)}))]
    # Batch 1's second rank reports a step later.
    assert tally.add(PrefetchReport.of_rank({1: []})) == [(1, frozenset({B(5)}))]
    assert tally.add(PrefetchReport.of_rank({1: []})) == []  # (a stray repeat waits alone)


def test_one_rank_completes_a_batch_at_once() -> None:
    tally = PrefetchTally(ranks=1)
    assert tally.add(PrefetchReport.of_rank({3: [B(1)]})) == [(3, frozenset({B(1)}))]
