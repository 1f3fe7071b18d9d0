"""The connector's background loader: loads run off the caller's thread and are reported once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from prefixmesh.cache_registry.types import BlockHash, Tier
from prefixmesh.replica.kvcache.loader import BackgroundLoader
from prefixmesh.replica.kvcache.plan import LoadJob, Prefetch, RequestLoad

JOBS = (LoadJob(BlockHash(1), Tier.CPU, 10), LoadJob(BlockHash(2), Tier.DISK, 11))


def no_prefetch(prefetch: Prefetch) -> list[BlockHash]:
    raise AssertionError("no promotion was submitted")


def wait_done(loader: BackgroundLoader, count: int) -> tuple[set[str], list[LoadJob]]:
    done: set[str] = set()
    failed: list[LoadJob] = []
    deadline = time.monotonic() + 10
    while len(done) < count and time.monotonic() < deadline:
        more, bad = loader.take_done()
        done |= more
        failed += bad
        time.sleep(0.005)
    return done, failed


def test_loads_run_on_their_own_thread_in_order_and_report_failures() -> None:
    ran: list[tuple[str, tuple[LoadJob, ...]]] = []
    gate = threading.Event()

    def load(jobs: Sequence[LoadJob]) -> list[LoadJob]:
        gate.wait(10)
        ran.append((threading.current_thread().name, tuple(jobs)))
        return [job for job in jobs if job.tier is Tier.DISK]

    loader = BackgroundLoader(load, nice=10, device=torch.device("cpu"), prefetch=no_prefetch)
    try:
        loader.submit(RequestLoad("a", JOBS, 0.0))
        loader.submit(RequestLoad("b", JOBS[:1], 0.0))
        assert loader.take_done() == (set(), [])  # the caller never waits for a load
        gate.set()
        done, failed = wait_done(loader, 2)
    finally:
        loader.close()
    assert done == {"a", "b"}
    assert failed == [JOBS[1]]
    assert ran == [("prefixmesh-kv-loader", JOBS), ("prefixmesh-kv-loader", JOBS[:1])]
    assert loader.take_done() == (set(), [])  # reported once


def test_a_load_that_raises_fails_all_its_blocks_and_the_loader_goes_on() -> None:
    calls = 0

    def load(jobs: Sequence[LoadJob]) -> list[LoadJob]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("disk gone")
        return []

    loader = BackgroundLoader(load, nice=0, device=torch.device("cpu"), prefetch=no_prefetch)
    try:
        loader.submit(RequestLoad("bad", JOBS, 0.0))
        loader.submit(RequestLoad("good", JOBS, 0.0))
        done, failed = wait_done(loader, 2)
    finally:
        loader.close()
    assert done == {"bad", "good"} and failed == list(JOBS)


def test_promotions_run_only_while_no_load_waits_and_are_reported_once() -> None:
    ran: list[str] = []
    gate = threading.Event()

    def load(jobs: Sequence[LoadJob]) -> list[LoadJob]:
        ran.append(f"load {jobs[0].block}")
        return []

    def prefetch(promotion: Prefetch) -> list[BlockHash]:
        gate.wait(10)  # the first promotion holds the thread while the rest queue up
        ran.append(f"promote {promotion.batch}")
        if promotion.batch == 2:
            raise OSError("disk gone")
        return list(promotion.blocks[1:])

    loader = BackgroundLoader(load, nice=0, device=torch.device("cpu"), prefetch=prefetch)
    try:
        loader.submit_prefetch(Prefetch(0, (BlockHash(1),), (False,)))
        time.sleep(0.05)  # the thread took promotion 0
        loader.submit_prefetch(Prefetch(1, (BlockHash(2), BlockHash(3)), (False, True)))
        loader.submit_prefetch(Prefetch(2, (BlockHash(4),), (False,)))
        loader.submit(RequestLoad("a", JOBS[:1], 0.0))
        gate.set()
        done, _ = wait_done(loader, 1)
        deadline = time.monotonic() + 10
        prefetched: dict[int, list[BlockHash]] = {}
        while len(prefetched) < 3 and time.monotonic() < deadline:
            prefetched |= loader.take_prefetched()
            time.sleep(0.005)
    finally:
        loader.close()
    assert done == {"a"}
    # The load queued behind promotion 0 goes before the promotions queued before it.
    assert ran == ["promote 0", "load 1", "promote 1", "promote 2"]
    assert prefetched == {0: [], 1: [BlockHash(3)], 2: [BlockHash(4)]}
    assert loader.take_prefetched() == {}
