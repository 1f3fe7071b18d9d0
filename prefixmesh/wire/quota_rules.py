"""Token quotas' arithmetic (issue 17): a sliding minute and a concurrency count per tenant.

Pure: no I/O, the time is an argument. The in-process store runs these functions and the
Redis store's script (``cache_registry/redis_quota.py``) runs the same arithmetic, step for
step, in Lua; a parity test holds them together.

The sliding minute is the usual two-window estimate (as Cloudflare's and NGINX's limiters):
tokens counted in the current fixed minute plus the previous minute's, weighted by how much of
it the sliding minute still covers. It needs two numbers a tenant, not a log of requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

WINDOW_MS = 60_000
CONCURRENCY_RETRY_MS = 1_000
"""When a concurrency slot frees is unknown: the client is told to try again in a second."""

Limit = Literal["", "tokens", "concurrency", "too_large"]
LIMIT_CODES: tuple[Limit, ...] = ("", "tokens", "concurrency", "too_large")
"""The script answers a limit as its index here."""


@dataclass(frozen=True, slots=True)
class QuotaWindow:
    """A tenant's tokens in fixed minute ``window`` (``current``) and the one before."""

    window: int
    current: int = 0
    previous: int = 0

    def rolled(self, now_ms: int) -> QuotaWindow:
        """The same counts seen at ``now_ms`` (a clock behind the stored window keeps it)."""
        window = now_ms // WINDOW_MS
        if window <= self.window:
            return self
        if window == self.window + 1:
            return QuotaWindow(window, 0, self.current)
        return QuotaWindow(window, 0, 0)

    def fraction(self, now_ms: int) -> float:
        """How far into its window ``now_ms`` is, in [0, 1]."""
        return min(1.0, max(0.0, (now_ms - self.window * WINDOW_MS) / WINDOW_MS))

    def used(self, now_ms: int) -> float:
        return self.previous * (1 - self.fraction(now_ms)) + self.current

    def charged(self, tokens: int) -> QuotaWindow:
        return QuotaWindow(self.window, self.current + tokens, self.previous)


def wait_ms(window: QuotaWindow, room: int, now_ms: int) -> int:
    """Milliseconds until ``window``'s sliding minute holds at most ``room`` tokens (at least 1:
    called only when it holds more now)."""
    fraction = window.fraction(now_ms)
    if window.current > room:
        # Only after this window ends: then it is the previous one and decays.
        after = 1 - room / window.current
        return max(1, math.ceil((1 - fraction) * WINDOW_MS + after * WINDOW_MS))
    if window.previous <= 0:
        return 1
    reached = 1 - (room - window.current) / window.previous
    return max(1, math.ceil((reached - fraction) * WINDOW_MS))


@dataclass(frozen=True, slots=True)
class Admission:
    """What a quota check decided for one request."""

    limit: Limit = ""
    """The limit that refused it; empty when admitted."""
    retry_after_ms: int = 0
    """When the client may try again (0: no time helps, or admitted)."""
    used_tokens: int = 0
    """The tenant's tokens in the sliding minute before this request."""
    active: int = 0
    """The tenant's running requests before this one."""

    @property
    def admitted(self) -> bool:
        return not self.limit


def decide(
    window: QuotaWindow,
    active: int,
    tokens: int,
    now_ms: int,
    tokens_per_minute: int,
    concurrent_requests: int,
) -> Admission:
    """Admit a request of ``tokens`` prompt tokens or name the limit it hits (0: no limit).
    ``window`` is already rolled to ``now_ms`` and ``active`` counts unexpired requests."""
    used = window.used(now_ms)
    floor_used = math.floor(used)
    if concurrent_requests and active >= concurrent_requests:
        return Admission("concurrency", CONCURRENCY_RETRY_MS, floor_used, active)
    if tokens_per_minute and tokens > tokens_per_minute:
        return Admission("too_large", 0, floor_used, active)
    if tokens_per_minute and used + tokens > tokens_per_minute:
        retry = wait_ms(window, tokens_per_minute - tokens, now_ms)
        return Admission("tokens", retry, floor_used, active)
    return Admission("", 0, floor_used, active)
