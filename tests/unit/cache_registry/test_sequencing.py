from __future__ import annotations

import pytest

from prefixmesh.cache_registry.sequencing import (
    SeqAction,
    SeqDecision,
    SequenceState,
    check_sequence,
)
from prefixmesh.cache_registry.types import CacheEvent, EventKind, ReplicaId


def event(seq: int, epoch: int = 1) -> CacheEvent:
    return CacheEvent(EventKind.CLEARED, ReplicaId("r"), seq=seq, epoch=epoch, tier=None)


@pytest.mark.parametrize(
    ("state", "incoming", "expected"),
    [
        (None, event(0), SeqDecision(SeqAction.APPLY, gap=False)),
        (None, event(5), SeqDecision(SeqAction.APPLY, gap=True)),
        (SequenceState(1, 3), event(4), SeqDecision(SeqAction.APPLY, gap=False)),
        (SequenceState(1, 3), event(6), SeqDecision(SeqAction.APPLY, gap=True)),
        (SequenceState(1, 3), event(3), SeqDecision(SeqAction.SKIP, gap=False)),
        (SequenceState(1, 3), event(0), SeqDecision(SeqAction.SKIP, gap=False)),
        (SequenceState(1, 3), event(0, epoch=2), SeqDecision(SeqAction.RESET_AND_APPLY, False)),
        (SequenceState(1, 3), event(2, epoch=2), SeqDecision(SeqAction.RESET_AND_APPLY, True)),
        (SequenceState(2, 3), event(9, epoch=1), SeqDecision(SeqAction.SKIP, gap=False)),
    ],
)
def test_sequence_rule(
    state: SequenceState | None, incoming: CacheEvent, expected: SeqDecision
) -> None:
    assert check_sequence(state, incoming) == expected


def test_epoch_must_fit_a_double() -> None:
    with pytest.raises(ValueError, match="epoch"):
        check_sequence(None, event(0, epoch=2**53))


def test_events_validate_their_shape() -> None:
    with pytest.raises(ValueError, match="seq"):
        event(-1)
    with pytest.raises(ValueError, match="tier"):
        CacheEvent(EventKind.STORED, ReplicaId("r"), seq=0, tier=None)
    with pytest.raises(ValueError, match="no block hashes"):
        CacheEvent(EventKind.CLEARED, ReplicaId("r"), seq=0, block_hashes=(1,))  # type: ignore[arg-type]
