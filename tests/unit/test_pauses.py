from __future__ import annotations

import asyncio
import gc

from prefixmesh.pauses import GcPauseRecorder, freeze_startup_heap, sample_loop_lag
from tests.fakes.clock import FakeClock


def test_each_collection_pass_is_timed_by_generation() -> None:
    clock = FakeClock()
    seen: list[tuple[int, float]] = []
    recorder = GcPauseRecorder(lambda gen, s: seen.append((gen, s)), clock=clock)
    recorder("start", {"generation": 2})
    clock.advance(0.3)
    recorder("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    recorder("stop", {"generation": 0})  # a stop without its start is ignored
    assert [(gen, round(s, 6)) for gen, s in seen] == [(2, 0.3)]


def test_the_recorder_sees_real_collections_once_installed() -> None:
    seen: list[int] = []
    recorder = GcPauseRecorder(lambda gen, s: seen.append(gen))
    recorder.install()
    recorder.install()  # idempotent
    try:
        gc.collect(1)
    finally:
        recorder.uninstall()
    assert seen == [1]
    gc.collect(1)
    assert seen == [1]


def test_freezing_moves_survivors_out_of_collection() -> None:
    try:
        assert freeze_startup_heap() > 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_loop_lag_is_how_late_each_wake_up_was_and_whether_the_process_ran() -> None:
    clock, cpu = FakeClock(), FakeClock()
    # (seconds late, CPU seconds this process used over the sleep)
    wakeups = iter([(0.0, 0.0), (0.2, 0.24), (0.3, 0.01)])

    async def sleep(seconds: float) -> None:
        late, ran = next(wakeups)
        clock.advance(seconds + late)
        cpu.advance(ran)

    lags: list[tuple[float, str]] = []
    asyncio.run(
        sample_loop_lag(
            lambda lag, cause: lags.append((round(lag, 6), cause)),
            0.05,
            clock=clock,
            cpu_clock=cpu,
            sleep=sleep,
            samples=3,
        )
    )
    assert lags == [(0.0, "off_cpu"), (0.2, "running"), (0.3, "off_cpu")]
