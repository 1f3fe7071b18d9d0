"""Token quotas' arithmetic (issue 17): a sliding window and a concurrency count per tenant.

Pure: no I/O, the time is an argument. The in-process store runs these functions and the
Redis store's script (``cache_registry/redis_quota.py``) runs the same arithmetic, step for
step, in Lua; a parity test holds them together.

The sliding window is the usual two-window estimate (as Cloudflare's and NGINX's limiters):
tokens counted in the current fixed window plus the previous one's, weighted by how much of it
the sliding window still covers. It needs two numbers a tenant, not a log of requests. The
window may be shorter than the minute the quota is stated in (``quotas.window_s``), as OpenAI
enforces per-minute limits over shorter periods: a tenant then cannot spend its minute at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MINUTE_MS = 60_000
CONCURRENCY_RETRY_MS = 1_000
"""When a concurrency slot frees is unknown: the client is told to try again in a second."""

Limit = Literal["", "tokens", "concurrency", "too_large"]
LIMIT_CODES: tuple[Limit, ...] = ("", "tokens", "concurrency", "too_large")
"""The script answers a limit as its index here."""


@dataclass(frozen=True, slots=True)
class QuotaWindow:
    """A tenant's tokens in fixed window number ``window`` (``current``) and the one before,
    windows being ``width_ms`` long."""

    window: int
    width_ms: int
    current: int = 0
    previous: int = 0

    @classmethod
    def empty(cls, now_ms: int, width_ms: int) -> QuotaWindow:
        return cls(now_ms // width_ms, width_ms)

    def rolled(self, now_ms: int) -> QuotaWindow:
        """The same counts seen at ``now_ms`` (a clock behind the stored window keeps it)."""
        window = now_ms // self.width_ms
        if window <= self.window:
            return self
        if window == self.window + 1:
            return QuotaWindow(window, self.width_ms, 0, self.current)
        return QuotaWindow(window, self.width_ms)

    def fraction(self, now_ms: int) -> float:
        """How far into its window ``now_ms`` is, in [0, 1]."""
        return min(1.0, max(0.0, (now_ms - self.window * self.width_ms) / self.width_ms))

    def used(self, now_ms: int) -> float:
        return self.previous * (1 - self.fraction(now_ms)) + self.current

    def charged(self, tokens: int) -> QuotaWindow:
        return QuotaWindow(self.window, self.width_ms, self.current + tokens, self.previous)


def window_limit(tokens_per_minute: int, width_ms: int) -> float:
    """The tokens a sliding window of ``width_ms`` allows (a minute's quota, pro rata)."""
    return tokens_per_minute * width_ms / MINUTE_MS


def wait_ms(window: QuotaWindow, room: float, now_ms: int) -> int:
    """Milliseconds until ``window``'s sliding window holds at most ``room`` tokens (at least
    1: called only when it holds more now)."""
    width = window.width_ms
    fraction = window.fraction(now_ms)
    if window.current > room:
        # Only after this window ends: then it is the previous one and decays.
        after = 1 - room / window.current
        return max(1, math.ceil((1 - fraction) * width + after * width))
    if window.previous <= 0:
        return 1
    reached = 1 - (room - window.current) / window.previous
    return max(1, math.ceil((reached - fraction) * width))


@dataclass(frozen=True, slots=True)
class QuotaAsk:
    """One request asking a quota store to start: who, how many prompt tokens, when, and the
    tenant's limits (0: none)."""

    tenant: str
    request_id: str
    tokens: int
    now_ms: int
    tokens_per_minute: int
    concurrent_requests: int
    lease_ms: int
    """How long its concurrency slot lasts if it is never settled (its server died)."""
    window_ms: int


@dataclass(frozen=True, slots=True)
class Admission:
    """What a quota check decided for one request."""

    limit: Limit = ""
    """The limit that refused it; empty when admitted."""
    retry_after_ms: int = 0
    """When the client may try again (0: no time helps, or admitted)."""
    used_tokens: int = 0
    """The tenant's tokens in the sliding window before this request."""
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
    ``window`` is already rolled to ``now_ms`` and ``active`` counts unexpired requests.

    A window shorter than a minute allows its share of the minute's tokens, which spreads a
    tenant's minute instead of letting it arrive at once; a request larger than that share
    (but not than the minute's quota) is let in when the window is empty."""
    used = window.used(now_ms)
    floor_used = math.floor(used)
    if concurrent_requests and active >= concurrent_requests:
        return Admission("concurrency", CONCURRENCY_RETRY_MS, floor_used, active)
    if tokens_per_minute and tokens > tokens_per_minute:
        return Admission("too_large", 0, floor_used, active)
    allowed = window_limit(tokens_per_minute, window.width_ms)
    if tokens_per_minute and used > 0 and used + tokens > allowed:
        retry = wait_ms(window, max(0.0, allowed - tokens), now_ms)
        return Admission("tokens", retry, floor_used, active)
    return Admission("", 0, floor_used, active)
