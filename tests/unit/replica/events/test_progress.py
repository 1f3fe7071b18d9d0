from __future__ import annotations

import asyncio

from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import load_config
from prefixmesh.replica.events import progress as progress_module
from prefixmesh.replica.events.progress import ProgressReporter
from prefixmesh.wire.request_progress import RequestProgress

R = ReplicaId("r1")


class _Router:
    def __init__(self, fail: bool = False) -> None:
        self.received: list[RequestProgress] = []
        self.fail = fail

    async def request_progress(self, progress: RequestProgress) -> None:
        if self.fail:
            raise ConnectionError("router restarting")
        self.received.append(progress)


def test_a_batch_carries_first_tokens_and_ends_in_order_then_starts_empty() -> None:
    router = _Router()
    reporter = ProgressReporter(R, router, interval_s=0.005)
    reporter.first_token("a")
    reporter.first_token("b")
    reporter.finished("a")
    asyncio.run(reporter.flush())
    assert router.received == [RequestProgress(R, ("a", "b"), ("a",))]
    asyncio.run(reporter.flush())  # nothing new: nothing sent
    assert len(router.received) == 1


def test_a_batch_the_router_did_not_take_is_sent_again_before_newer_notes() -> None:
    # Dropping it left the router's ledger counting those requests for 600 s (a CI failure:
    # test_direct_path's ledger never emptied).
    router = _Router(fail=True)
    reporter = ProgressReporter(R, router, interval_s=0.005)
    reporter.first_token("a")
    reporter.finished("a")
    asyncio.run(reporter.flush())
    assert router.received == []
    router.fail = False
    reporter.finished("b")
    asyncio.run(reporter.flush())
    assert router.received == [RequestProgress(R, ("a",), ("a", "b"))]


def test_notes_are_bounded_while_nobody_takes_them() -> None:
    reporter = ProgressReporter(R, _Router(), interval_s=1.0)
    for i in range(progress_module.MAX_PENDING + 5):
        reporter.finished(str(i))
    taken = reporter.take()
    assert taken is not None
    assert len(taken.finished) == progress_module.MAX_PENDING
    assert taken.finished[0] == "5"


def test_the_reporter_runs_until_stopped_and_flushes_on_stop() -> None:
    router = _Router()

    async def run() -> None:
        reporter = ProgressReporter(R, router, interval_s=0.001)
        reporter.start()
        reporter.first_token("a")
        for _ in range(100):
            if router.received:
                break
            await asyncio.sleep(0.001)
        reporter.finished("a")
        await reporter.stop()

    asyncio.run(run())
    sent = [r for batch in router.received for r in (*batch.first_tokens, *batch.finished)]
    assert sent == ["a", "a"]


def test_only_the_direct_path_with_the_in_process_registry_pushes_progress() -> None:
    assert load_config().progress_to_router
    assert not load_config(overrides=["serving.path=proxy"]).progress_to_router
    assert not load_config(overrides=["registry.backend=redis"]).progress_to_router
