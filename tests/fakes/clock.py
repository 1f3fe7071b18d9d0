from __future__ import annotations


class FakeClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
