from __future__ import annotations

from prefixmesh.cache_registry.types import BlockHash, ReplicaId
from prefixmesh.router.core.ledger import OVERTAKEN_S, LedgerLoad, LoadLedger

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_request_moves_from_queued_to_running_to_gone() -> None:
    ledger = LoadLedger()
    assert ledger.routed("r1", A, 300)
    assert ledger.routed("r2", A, 100)
    assert ledger.routed("r3", B, 50)
    assert ledger.load() == {A: LedgerLoad(2, 0, 400), B: LedgerLoad(1, 0, 50)}
    ledger.first_token("r1")
    assert ledger.load()[A] == LedgerLoad(1, 1, 100)
    ledger.finished("r1")
    ledger.finished("r2")
    assert ledger.load() == {B: LedgerLoad(1, 0, 50)}
    assert len(ledger) == 1


def test_a_retried_decision_moves_the_request() -> None:
    ledger = LoadLedger()
    ledger.routed("r1", A, 300)
    assert not ledger.routed("r1", B, 200)
    assert ledger.load() == {B: LedgerLoad(1, 0, 200)}
    assert ledger.replica_of("r1") == B


def test_unknown_ids_and_dead_replicas() -> None:
    ledger = LoadLedger()
    ledger.first_token("nope")
    ledger.finished("nope")
    ledger.routed("r1", A, 10)
    ledger.routed("r2", B, 10)
    ledger.forget_replica(A)
    assert ledger.load() == {B: LedgerLoad(1, 0, 10)}
    assert ledger.replica_of("r1") is None


def test_a_claim_is_released_once_at_the_first_token_or_the_end() -> None:
    released: list[tuple[int, str]] = []
    ledger = LoadLedger(lambda prefix, replica: released.append((prefix, replica)))
    ledger.routed("r1", A, 300, claim=BlockHash(7))
    ledger.routed("r2", B, 300, claim=BlockHash(8))
    ledger.routed("r3", B, 300)
    ledger.first_token("r1")
    assert released == [(7, A)]
    ledger.finished("r1")
    ledger.finished("r2")  # ended without a first token: released all the same
    ledger.finished("r3")
    assert released == [(7, A), (8, B)]


def test_a_claim_follows_a_retried_decision() -> None:
    released: list[tuple[int, str]] = []
    ledger = LoadLedger(lambda prefix, replica: released.append((prefix, replica)))
    ledger.routed("r1", A, 300, claim=BlockHash(7))
    ledger.routed("r1", A, 300)  # the same replica again: the claim stays
    assert released == []
    ledger.routed("r1", B, 300)  # moved: A will not compute it
    assert released == [(7, A)]
    ledger.finished("r1")
    assert released == [(7, A)]
    ledger.forget_replica(B)


def test_a_decision_cut_short_moves_its_load_and_releases_its_claim() -> None:
    released: list[tuple[int, str]] = []
    ledger = LoadLedger(lambda prefix, replica: released.append((prefix, replica)))
    ledger.routed("r1", A, 300, claim=BlockHash(7))
    assert ledger.moved("r1", B)
    assert ledger.load() == {B: LedgerLoad(1, 0, 300)} and released == [(7, A)]
    ledger.finished("r1")  # the replica that served it ends it
    assert len(ledger) == 0 and released == [(7, A)]
    assert not ledger.moved("r1", A)


def test_requests_a_replica_reported_leave_the_ledger_with_their_claims() -> None:
    released: list[tuple[BlockHash, ReplicaId]] = []
    ledger = LoadLedger(lambda claim, replica: released.append((claim, replica)))
    ledger.routed("r1", A, 300, BlockHash(7), now_s=1.0)
    ledger.routed("r2", A, 100, now_s=1.0)
    ledger.routed("r3", B, 50, now_s=1.0)
    # The report lists r1 (arrived) and ids of other routers' requests.
    assert ledger.seen(["r1", "someone-elses"]) == 1
    assert released == [(BlockHash(7), A)]
    assert ledger.load() == {A: LedgerLoad(1, 0, 100), B: LedgerLoad(1, 0, 50)}
    assert ledger.seen(["r1"]) == 0  # listed again in the next report: nothing left to drop


def test_entries_no_report_ever_lists_expire() -> None:
    ledger = LoadLedger()
    ledger.routed("old", A, 300, now_s=1.0)
    ledger.routed("new", A, 100, now_s=9.0)
    assert ledger.expire(now_s=10.0, older_than_s=5.0) == 1
    assert ledger.load() == {A: LedgerLoad(1, 0, 100)}


def test_an_entry_overtaken_by_a_later_listed_one_never_arrived() -> None:
    """Requests to one replica arrive in the order they were routed: one its report leaves out
    while it lists ours routed OVERTAKEN_S later was lost on the way (a routing call that fell
    back after deciding, a client that left) and stops counting now, not at the expiry."""
    released: list[tuple[BlockHash, ReplicaId]] = []
    ledger = LoadLedger(lambda claim, replica: released.append((claim, replica)))
    ledger.routed("lost", A, 300, BlockHash(7), now_s=10.0)
    ledger.routed("just-before", A, 100, now_s=10.0 + OVERTAKEN_S - 0.5)
    ledger.routed("elsewhere", B, 50, now_s=10.0)
    ledger.routed("listed", A, 100, now_s=10.0 + OVERTAKEN_S + 0.5)
    assert ledger.seen(["listed"], by=A) == 2
    assert released == [(BlockHash(7), A)]
    # One routed shortly before may still be on its way; another replica's report says it.
    assert ledger.load() == {A: LedgerLoad(1, 0, 100), B: LedgerLoad(1, 0, 50)}
    # Redispatched to B: B lists it, and what B lists dates B's report, not A's entries.
    ledger.routed("moved", A, 100, now_s=20.0)
    assert ledger.seen(["moved"], by=B) == 2  # "moved", and B's "elsewhere" it overtook
    assert ledger.load() == {A: LedgerLoad(1, 0, 100)}
    # A report listing nothing new of ours says nothing about what is on its way.
    assert ledger.seen(["listed", "someone-elses"], by=A) == 0


def test_progress_moves_entries_and_drops_queued_ones_overtaken() -> None:
    """A decision whose request never reaches its replica (a routing call that fell back after
    deciding) stops counting once the replica reaches the first token of a request of ours
    routed OVERTAKEN_S later; a request of ours already running there stays."""
    from prefixmesh.router.core.ledger import OVERTAKEN_S

    released: list[object] = []
    ledger = LoadLedger(release_claim=lambda claim, replica: released.append(claim))
    r = ReplicaId("r")
    ledger.routed("running", r, 10, now_s=0.0)
    ledger.progressed(r, first_tokens=("running",), finished=())
    ledger.routed("fell-back", r, 10, claim=BlockHash(7), now_s=0.5)
    ledger.routed("other-replica", ReplicaId("q"), 10, now_s=0.5)
    ledger.routed("late", r, 10, now_s=OVERTAKEN_S + 1.0)
    assert ledger.progressed(r, first_tokens=("late",), finished=()) == 1
    assert ledger.replica_of("fell-back") is None
    assert released == [BlockHash(7)]
    assert ledger.load()[r] == LedgerLoad(0, 2, 0)
    assert ledger.replica_of("other-replica") == ReplicaId("q")
    assert ledger.progressed(r, first_tokens=(), finished=("running", "late", "unknown")) == 0
    assert r not in ledger.load()
