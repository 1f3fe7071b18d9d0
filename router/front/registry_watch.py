"""The router's view of its registry's health, one for both fronts (the direct path's router
and the proxy path's ingress): ``/health`` answers with it, Serve's periodic check refreshes it,
and ``prefixmesh_registry_degraded`` shows its reason."""

from __future__ import annotations

import logging

from prefixmesh.cache_registry.registry_health import RegistryProbe
from prefixmesh.router.core.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class RegistryWatch:
    def __init__(self, probe: RegistryProbe, metrics: RouterMetrics) -> None:
        self._probe = probe
        self._metrics = metrics

    async def health(self) -> dict[str, str]:
        """``{"status": "ok"}``, or ``degraded`` with the reason when the configured registry
        is unreachable, refuses the password or TLS, or holds another cluster's fingerprint
        (200 either way: routing goes on by load). One probe within the registry's op
        timeout, reused for a second; the reason also goes to ``prefixmesh_registry_degraded``."""
        verdict = await self._probe.check()
        self._metrics.registry_checked(verdict.reason)
        return verdict.body()

    async def refresh(self) -> None:
        """Serve's periodic check keeps the gauge current; a degraded registry never fails it
        (the router routes without it), and neither does a bug here."""
        try:
            await self.health()
        except Exception:  # the probe never raises
            logger.exception("registry health check failed")
