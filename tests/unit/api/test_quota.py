"""Token quotas per tenant (issue 17): admission and settlement through the in-process store,
OpenAI's 429 with retry-after, limits per tenant, and a failing store that never blocks a
request unless configured to."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from prefixmesh.api.errors import APIError, error_response
from prefixmesh.api.quota import QUOTA_UNAVAILABLE, RATE_LIMITED, MemoryQuotaStore, TenantQuotas
from prefixmesh.cache_registry.quota_rules import MINUTE_MS, Admission, QuotaAsk
from prefixmesh.config import QuotasConfig, TenantQuota, load_config


class Recorded:
    """The metrics a server would export."""

    def __init__(self) -> None:
        self.refused: Counter[tuple[str, str]] = Counter()
        self.store_errors = 0
        self.tokens: Counter[tuple[str, str]] = Counter()

    def quota_refused(self, tenant: str, limit: str) -> None:
        self.refused[tenant, limit] += 1

    def quota_store_failed(self) -> None:
        self.store_errors += 1

    def tenant_tokens(self, tenant: str, kind: str, tokens: int) -> None:
        self.tokens[tenant, kind] += tokens


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000 * MINUTE_MS / 1000  # the start of a fixed minute

    def __call__(self) -> float:
        return self.now_s


LIMITS = QuotasConfig(
    window_s=60,  # a whole minute: these tests count minutes
    default=TenantQuota(tokens_per_minute=1_000),
    tenants={"small": TenantQuota(tokens_per_minute=100, concurrent_requests=1)},
)


def quotas(
    limits: QuotasConfig = LIMITS, store: object | None = None
) -> tuple[TenantQuotas, Recorded, Clock]:
    metrics, clock = Recorded(), Clock()
    store = store if store is not None else MemoryQuotaStore()
    return TenantQuotas(limits, store, 60.0, metrics, clock), metrics, clock  # type: ignore[arg-type]


async def test_a_tenant_over_its_minute_gets_a_429_with_retry_after_and_others_do_not() -> None:
    gate, metrics, clock = quotas()
    for i in range(4):
        await gate.admit("team-a", f"a{i}", 250)
    with pytest.raises(APIError) as raised:
        await gate.admit("team-a", "a4", 1)
    error = raised.value
    assert (error.status, error.code, error.error_type) == (429, RATE_LIMITED, "tokens")
    assert "Limit 1000, Used 1000 in the last 60s, Requested 1" in error.message
    assert int(error.headers["retry-after-ms"]) > 0
    response = error_response(error)
    assert response.status_code == 429 and response.headers["retry-after"] == "61"
    await gate.admit("team-b", "b0", 900)  # another tenant's minute is its own
    assert metrics.refused == {("team-a", "tokens"): 1}
    assert metrics.tokens == {("team-a", "prompt"): 1_000, ("team-b", "prompt"): 900}
    # After the advertised wait the same request fits.
    clock.now_s += int(error.headers["retry-after-ms"]) / 1000
    await gate.admit("team-a", "a5", 1)


async def test_completions_count_when_the_request_settles_and_free_its_slot() -> None:
    gate, metrics, _ = quotas()
    slot = await gate.admit("small", "s0", 10)
    with pytest.raises(APIError) as busy:
        await gate.admit("small", "s1", 10)
    assert busy.value.error_type == "requests" and busy.value.headers["retry-after"] == "1"
    await gate.settle(slot, 85)  # 10 + 85 of 100 used
    with pytest.raises(APIError) as over:
        await gate.admit("small", "s2", 10)
    assert "Used 95" in over.value.message
    await gate.admit("small", "s3", 5)
    assert metrics.refused == {("small", "concurrency"): 1, ("small", "tokens"): 1}
    assert metrics.tokens[("small", "completion")] == 85


async def test_a_request_larger_than_the_whole_quota_is_told_so_without_a_wait() -> None:
    gate, metrics, _ = quotas()
    with pytest.raises(APIError) as raised:
        await gate.admit("small", "big", 101)
    assert raised.value.status == 429 and "Request too large" in raised.value.message
    assert "retry-after" not in raised.value.headers
    assert metrics.refused == {("small", "too_large"): 1}


async def test_the_default_window_spreads_a_tenant_s_minute() -> None:
    """10 s windows: a minute's 600 tokens come 100 at a time, not all at once."""
    limits = QuotasConfig(default=TenantQuota(tokens_per_minute=600))
    gate, _, clock = quotas(limits)
    await gate.admit("t", "r0", 60)
    await gate.admit("t", "r1", 40)
    with pytest.raises(APIError) as raised:
        await gate.admit("t", "r2", 10)
    assert "Used 100 in the last 10s" in raised.value.message
    clock.now_s += int(raised.value.headers["retry-after-ms"]) / 1000
    await gate.admit("t", "r2", 10)


async def test_a_slot_whose_server_never_settled_frees_when_its_lease_ends() -> None:
    gate, _, clock = quotas()
    await gate.admit("small", "lost", 1)
    clock.now_s += 60.0 + 5.0 + 0.001  # request timeout + margin
    await gate.admit("small", "next", 1)


class BrokenStore(MemoryQuotaStore):
    def __init__(self, hang: bool = False) -> None:
        super().__init__()
        self.hang = hang

    async def admit(self, ask: QuotaAsk) -> Admission:
        if self.hang:
            await asyncio.sleep(3600)
        raise ConnectionError("redis down")

    async def settle(self, *args: object) -> None:  # type: ignore[override]
        raise ConnectionError("redis down")


@pytest.mark.parametrize("hang", [False, True])
async def test_a_failing_or_slow_store_lets_requests_in_and_is_counted(hang: bool) -> None:
    gate, metrics, _ = quotas(store=BrokenStore(hang))
    slot = await gate.admit("team-a", "a0", 10)
    await gate.settle(slot, 5)
    assert metrics.store_errors == 2


async def test_fail_closed_answers_503_when_the_store_fails() -> None:
    limits = LIMITS.model_copy(update={"fail_closed": True})
    gate, metrics, _ = quotas(limits, BrokenStore())
    with pytest.raises(APIError) as raised:
        await gate.admit("team-a", "a0", 10)
    assert (raised.value.status, raised.value.code) == (503, QUOTA_UNAVAILABLE)
    assert metrics.store_errors == 1


async def test_a_tenant_without_limits_is_not_checked_but_its_tokens_are_counted() -> None:
    limits = QuotasConfig(tenants={"small": TenantQuota(tokens_per_minute=100)})
    gate, metrics, _ = quotas(limits, BrokenStore())
    slot = await gate.admit("free", "f0", 10**6)
    await gate.settle(slot, 7)
    assert metrics.store_errors == 0 and metrics.tokens[("free", "prompt")] == 10**6
    assert metrics.tokens[("free", "completion")] == 7


def test_quotas_are_off_by_default_and_set_per_tenant_from_overrides() -> None:
    assert TenantQuotas.from_config(load_config(), Recorded()) is None
    config = load_config(
        overrides=[
            "quotas.default.tokens_per_minute=5000",
            "quotas.tenants.team-b.concurrent_requests=2",
        ]
    )
    assert config.quotas.enabled
    assert config.quotas.limit_of("team-a") == TenantQuota(tokens_per_minute=5000)
    assert config.quotas.limit_of("team-b") == TenantQuota(concurrent_requests=2)
    assert TenantQuotas.from_config(config, Recorded()) is not None
