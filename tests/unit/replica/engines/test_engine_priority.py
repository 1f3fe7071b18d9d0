"""The engine's workers below the serving processes: every thread of a child raised to the
niceness, a thread started afterwards inheriting it, nothing lowered, a gone process skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from prefixmesh.replica.engines.engine_priority import (
    child_pids,
    is_resource_tracker,
    lower_priority,
)

# A child with a second thread, which starts a third once it reads a line.
CHILD = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("again", flush=True)
time.sleep(60)
"""


def nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()]


def test_every_thread_is_set_and_later_threads_inherit_it() -> None:
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process runs at the highest niceness already")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in child_pids()
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        target = min(mine + 5, 19)
        assert lower_priority([child.pid], target) == 2  # main thread and the sleeper
        assert nices(child.pid) == [target, target]
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "again"
        assert nices(child.pid) == [target] * 3
        assert lower_priority([child.pid], mine) == 0  # never lowered
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # this process is untouched
    finally:
        child.terminate()
        child.wait(timeout=10)
    deadline = time.monotonic() + 5
    while child.pid in child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lower_priority([child.pid], 19) == 0  # gone: skipped


def test_the_resource_tracker_is_told_apart() -> None:
    tracker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)  # multiprocessing.resource_tracker"]
    )
    try:
        assert is_resource_tracker(tracker.pid)
        assert not is_resource_tracker(os.getpid())
    finally:
        tracker.kill()
        tracker.wait()
