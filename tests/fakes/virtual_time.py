"""An asyncio event loop on virtual time, for code whose waits are the loop's timers
(``asyncio.wait_for``, ``asyncio.sleep``, ``loop.time()``): when nothing is ready to run, the
clock jumps to the next timer instead of sleeping, so a test of a 5 s bound takes no time and
asserts exact durations. Only for code that does no I/O: a loop with nothing scheduled and
nothing ready would wait forever, and raises instead."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Selector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)  # the loop's own wake-up pipe, nothing else
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("nothing scheduled and nothing ready: the test would hang")
        assert self.loop is not None
        self.loop.now_s += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start_s: float = 0.0) -> None:
        selector = _Selector()
        super().__init__(selector)
        selector.loop = self
        self.now_s = start_s

    def time(self) -> float:
        return self.now_s


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()
