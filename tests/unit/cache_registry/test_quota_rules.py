"""Token quotas' arithmetic (issue 17): the sliding minute, the wait a refusal names, the
concurrency cap, and a request larger than the whole quota."""

from __future__ import annotations

import pytest

from prefixmesh.cache_registry.quota_rules import (
    CONCURRENCY_RETRY_MS,
    MINUTE_MS,
    QuotaWindow,
    decide,
    wait_ms,
)

W = MINUTE_MS  # a window of a whole minute, except where a test says otherwise
T0 = 1_000 * W  # the start of a fixed window


def test_the_window_rolls_into_the_previous_one_and_then_empties() -> None:
    window = QuotaWindow(T0 // W, W, current=600, previous=100)
    assert window.rolled(T0 + 59_999) is window
    assert window.rolled(T0 + W) == QuotaWindow(T0 // W + 1, W, 0, 600)
    assert window.rolled(T0 + 2 * W) == QuotaWindow(T0 // W + 2, W, 0, 0)
    # A clock behind the stored window keeps it (another server's clock ran ahead).
    assert window.rolled(T0 - 5_000) is window
    assert window.fraction(T0 - 5_000) == 0.0


def test_the_previous_minute_counts_by_how_much_the_sliding_minute_still_covers() -> None:
    window = QuotaWindow(T0 // W, W, current=100, previous=600)
    assert window.used(T0) == 700
    assert window.used(T0 + W // 4) == pytest.approx(550)
    assert window.used(T0 + W // 2) == pytest.approx(400)


def test_a_request_is_admitted_while_the_minute_has_room_for_its_prompt() -> None:
    window = QuotaWindow(T0 // W, W, current=900)
    admitted = decide(window, 0, 100, T0 + 1, 1_000, 0)
    assert admitted.admitted and admitted.used_tokens == 900
    refused = decide(window, 0, 101, T0 + 1, 1_000, 0)
    assert refused.limit == "tokens" and not refused.admitted
    # 900 tokens stay in this window: room for 899 comes only when it slides out.
    assert refused.retry_after_ms == wait_ms(window, 899, T0 + 1)
    assert W < refused.retry_after_ms < 2 * W


def test_the_wait_ends_exactly_when_the_sliding_minute_has_room() -> None:
    window = QuotaWindow(T0 // W, W, current=200, previous=800)
    now = T0 + 6_000
    tokens, limit = 300, 1_000
    refused = decide(window, 0, tokens, now, limit, 0)
    assert refused.limit == "tokens"
    later = now + refused.retry_after_ms
    assert window.rolled(later).used(later) + tokens <= limit
    earlier = later - 2
    assert window.rolled(earlier).used(earlier) + tokens > limit


def test_a_wait_past_the_window_s_end_is_also_exact() -> None:
    window = QuotaWindow(T0 // W, W, current=900, previous=0)
    now = T0 + 30_000
    refused = decide(window, 0, 200, now, 1_000, 0)
    later = now + refused.retry_after_ms
    assert window.rolled(later).used(later) + 200 <= 1_000
    earlier = later - 2
    assert window.rolled(earlier).used(earlier) + 200 > 1_000


def test_the_concurrency_cap_comes_first_and_a_request_over_the_whole_quota_never_fits() -> None:
    window = QuotaWindow(T0 // W, W)
    busy = decide(window, 2, 10, T0, 1_000, 2)
    assert (busy.limit, busy.retry_after_ms, busy.active) == (
        "concurrency",
        CONCURRENCY_RETRY_MS,
        2,
    )
    assert decide(window, 1, 10, T0, 1_000, 2).admitted
    too_large = decide(window, 0, 1_001, T0, 1_000, 0)
    assert (too_large.limit, too_large.retry_after_ms) == ("too_large", 0)


def test_a_short_window_allows_its_share_of_the_minute_and_an_empty_one_any_request() -> None:
    ten_s = 10_000
    window = QuotaWindow.empty(T0, ten_s)
    # 6,000 a minute is 1,000 per 10 s: a 1,500-token prompt fits only in an empty window.
    assert decide(window, 0, 1_500, T0, 6_000, 0).admitted
    charged = window.charged(1_500)
    refused = decide(charged, 0, 100, T0 + 1_000, 6_000, 0)
    assert refused.limit == "tokens"
    later = T0 + 1_000 + refused.retry_after_ms
    assert charged.rolled(later).used(later) + 100 <= 1_000
    assert decide(charged, 0, 6_001, T0, 6_000, 0).limit == "too_large"


def test_zero_means_no_limit() -> None:
    window = QuotaWindow(T0 // W, W, current=10**9)
    assert decide(window, 10**6, 10**6, T0, 0, 0).admitted
