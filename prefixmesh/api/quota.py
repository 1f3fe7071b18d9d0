"""Token quotas per tenant (issue 17, ``quotas`` config): who may start a request now.

The server that answers a request (the direct path's replica, the proxy path's ingress) asks
``TenantQuotas.admit`` once the prompt is tokenized: the tenant's sliding minute must have room
for the prompt, and its running requests must be under their cap. An admitted request holds a
``QuotaSlot``; when it ends, ``settle`` counts its completion tokens and frees the slot. A
refusal is OpenAI's 429 (``rate_limit_exceeded``) with ``retry-after``.

The count lives in the registry's Redis when there is one (every server of the cluster shares
it) and in the process otherwise. A store that fails or is slow never blocks a request: it is
let in and counted (``fail_closed`` refuses it with a 503 instead).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prefixmesh.api.errors import APIError
from prefixmesh.cache_registry.quota_rules import Admission, QuotaAsk, QuotaWindow, decide
from prefixmesh.config import PrefixmeshConfig, QuotasConfig

logger = logging.getLogger(__name__)

RATE_LIMITED = "rate_limit_exceeded"
QUOTA_UNAVAILABLE = "quota_store_unavailable"
LEASE_MARGIN_S = 5.0
"""A running request's slot outlives the request timeout by this much (a server that died
without settling frees it then)."""


class QuotaStore(Protocol):
    async def admit(self, ask: QuotaAsk) -> Admission: ...

    async def settle(
        self, tenant: str, request_id: str, tokens: int, now_ms: int, window_ms: int
    ) -> None: ...

    async def close(self) -> None: ...


class QuotaMetrics(Protocol):
    def quota_refused(self, tenant: str, limit: str) -> None: ...

    def quota_store_failed(self) -> None: ...

    def tenant_tokens(self, tenant: str, kind: str, tokens: int) -> None: ...


class MemoryQuotaStore:
    """``QuotaStore`` in the process (the ``memory`` registry: one server counts)."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, int], QuotaWindow] = {}
        self._active: dict[str, dict[str, int]] = {}

    def _rolled(self, tenant: str, now_ms: int, window_ms: int) -> QuotaWindow:
        window = self._windows.get((tenant, window_ms)) or QuotaWindow.empty(now_ms, window_ms)
        return window.rolled(now_ms)

    def _running(self, tenant: str, now_ms: int) -> dict[str, int]:
        running = self._active.setdefault(tenant, {})
        for request_id in [r for r, until in running.items() if until <= now_ms]:
            del running[request_id]
        return running

    async def admit(self, ask: QuotaAsk) -> Admission:
        window = self._rolled(ask.tenant, ask.now_ms, ask.window_ms)
        running = self._running(ask.tenant, ask.now_ms)
        admission = decide(
            window,
            len(running),
            ask.tokens,
            ask.now_ms,
            ask.tokens_per_minute,
            ask.concurrent_requests,
        )
        if admission.admitted:
            self._windows[ask.tenant, ask.window_ms] = window.charged(ask.tokens)
            if ask.concurrent_requests:
                running[ask.request_id] = ask.now_ms + ask.lease_ms
        return admission

    async def settle(
        self, tenant: str, request_id: str, tokens: int, now_ms: int, window_ms: int
    ) -> None:
        if tokens > 0:
            rolled = self._rolled(tenant, now_ms, window_ms)
            self._windows[tenant, window_ms] = rolled.charged(tokens)
        self._active.get(tenant, {}).pop(request_id, None)

    async def close(self) -> None:
        return None


def make_quota_store(config: PrefixmeshConfig) -> QuotaStore:
    if config.registry.backend == "redis":
        from prefixmesh.cache_registry.redis_connection import RedisEndpoint
        from prefixmesh.cache_registry.redis_quota import RedisQuotaStore

        return RedisQuotaStore(
            RedisEndpoint.from_config(config.registry),
            config.registry.namespace,
            config.quotas.store_timeout_ms / 1000,
        )
    return MemoryQuotaStore()


@dataclass(frozen=True, slots=True)
class QuotaSlot:
    """An admitted request's claim on its tenant's quota, until it is settled."""

    tenant: str
    request_id: str


def rate_limited(tenant: str, admission: Admission, tokens: int, limits: QuotasConfig) -> APIError:
    """OpenAI's 429 for a refusal, with ``retry-after`` (seconds) and ``retry-after-ms``."""
    quota = limits.limit_of(tenant)
    if admission.limit == "concurrency":
        message = (
            f"Rate limit reached for tenant {tenant} on concurrent requests: "
            f"Limit {quota.concurrent_requests}, Running {admission.active}."
        )
    elif admission.limit == "too_large":
        message = (
            f"Request too large for tenant {tenant} on tokens per min (TPM): "
            f"Limit {quota.tokens_per_minute}, Requested {tokens}."
        )
    else:
        message = (
            f"Rate limit reached for tenant {tenant} on tokens per min (TPM): "
            f"Limit {quota.tokens_per_minute}, Used {admission.used_tokens} in the last "
            f"{limits.window_s:g}s, Requested {tokens}."
        )
    headers: dict[str, str] = {}
    if admission.retry_after_ms:
        message += f" Please try again in {admission.retry_after_ms / 1000:.3g}s."
        headers["retry-after"] = str(math.ceil(admission.retry_after_ms / 1000))
        headers["retry-after-ms"] = str(admission.retry_after_ms)
    kind = "requests" if admission.limit == "concurrency" else "tokens"  # OpenAI's types
    return APIError(429, message, error_type=kind, code=RATE_LIMITED, headers=headers)


class TenantQuotas:
    """The quota checks of one server: admit, then settle when the request ends."""

    def __init__(
        self,
        limits: QuotasConfig,
        store: QuotaStore,
        lease_s: float,
        metrics: QuotaMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._limits = limits
        self._store = store
        self._lease_ms = int((lease_s + LEASE_MARGIN_S) * 1000)
        self._metrics = metrics
        self._clock = clock
        self._timeout_s = limits.store_timeout_ms / 1000
        self._window_ms = round(limits.window_s * 1000)
        self._settling: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: PrefixmeshConfig, metrics: QuotaMetrics) -> TenantQuotas | None:
        """None when no tenant has a limit (no store, no check)."""
        if not config.quotas.enabled:
            return None
        store = make_quota_store(config)
        return cls(config.quotas, store, config.ingress.request_timeout_s, metrics)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def admit(self, tenant: str, request_id: str, prompt_tokens: int) -> QuotaSlot:
        """The request's slot; raises a 429 over quota, a 503 when the store fails closed."""
        quota = self._limits.limit_of(tenant)
        slot = QuotaSlot(tenant, request_id)
        if not quota.limited:
            self._metrics.tenant_tokens(tenant, "prompt", prompt_tokens)
            return slot
        try:
            admission = await asyncio.wait_for(
                self._store.admit(
                    QuotaAsk(
                        tenant,
                        request_id,
                        prompt_tokens,
                        self._now_ms(),
                        quota.tokens_per_minute,
                        quota.concurrent_requests,
                        self._lease_ms,
                        self._window_ms,
                    )
                ),
                self._timeout_s,
            )
        except Exception as exc:
            self._metrics.quota_store_failed()
            logger.warning("quota store failed (%s): %s", type(exc).__name__, exc)
            if self._limits.fail_closed:
                raise APIError(
                    503,
                    "The quota store is unavailable; try again later.",
                    error_type="server_error",
                    code=QUOTA_UNAVAILABLE,
                ) from None
            admission = Admission()
        if not admission.admitted:
            self._metrics.quota_refused(tenant, admission.limit)
            raise rate_limited(tenant, admission, prompt_tokens, self._limits)
        self._metrics.tenant_tokens(tenant, "prompt", prompt_tokens)
        return slot

    async def settle(self, slot: QuotaSlot, completion_tokens: int) -> None:
        """Count the completion and free the slot (a failure is counted, never raised)."""
        self._metrics.tenant_tokens(slot.tenant, "completion", completion_tokens)
        if not self._limits.limit_of(slot.tenant).limited:
            return  # admitted without the store: nothing there to settle
        try:
            await asyncio.wait_for(
                self._store.settle(
                    slot.tenant, slot.request_id, completion_tokens, self._now_ms(), self._window_ms
                ),
                self._timeout_s,
            )
        except Exception as exc:
            self._metrics.quota_store_failed()
            logger.warning("quota settle failed (%s): %s", type(exc).__name__, exc)

    def settle_soon(self, slot: QuotaSlot, completion_tokens: int) -> None:
        """``settle`` from a synchronous end-of-request callback."""
        task = asyncio.get_running_loop().create_task(self.settle(slot, completion_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def close(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self._store.close()


async def charge(
    quotas: TenantQuotas | None, tenant: str, request_id: str, prompt_tokens: int
) -> QuotaSlot | None:
    """A server's quota check of a prepared request (None: the server has no quotas): its
    slot, or the 429 or 503 ``TenantQuotas.admit`` raises."""
    if quotas is None:
        return None
    return await quotas.admit(tenant, request_id, prompt_tokens)


def settle_soon(
    quotas: TenantQuotas | None, slot: QuotaSlot | None, completion_tokens: int
) -> None:
    """The request ended: its completion counts against its tenant's quota (no quotas, no
    slot: nothing to settle)."""
    if slot is not None and quotas is not None:
        quotas.settle_soon(slot, completion_tokens)
