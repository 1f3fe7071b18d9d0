"""``/health`` of the router (direct path) and the ingress (proxy path): 200 with ``ok``, or
``degraded`` and the reason when the registry is not usable, the reason in
``prefixmesh_registry_degraded``; Serve's periodic check refreshes it and never fails."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from prefixmesh.cache_registry.factory import make_registry_probe
from prefixmesh.cache_registry.registry_health import (
    DEGRADED_REASONS,
    HEALTHY,
    RedisProbe,
    RegistryHealth,
)
from prefixmesh.config import REDIS_URL_ENV, load_config
from prefixmesh.ports import free_port
from prefixmesh.router.core.metrics import RouterMetrics
from prefixmesh.router.front.ingress import IngressServer
from prefixmesh.router.front.registry_watch import RegistryWatch
from prefixmesh.router.front.route_server import RouterServer
from tests.unit.router.core.test_metrics import samples

AUTH = RegistryHealth("auth", "redis://h:1/0 refused the password from $PREFIXMESH_REDIS_PASSWORD")


class _Probe:
    def __init__(self, *verdicts: RegistryHealth) -> None:
        self.verdicts = list(verdicts)
        self.checks = 0

    async def check(self) -> RegistryHealth:
        self.checks += 1
        return self.verdicts.pop(0)

    async def close(self) -> None:
        return None


def degraded(metrics: RouterMetrics) -> dict[str, float]:
    got = samples(metrics.render())
    return {
        reason: got[("prefixmesh_registry_degraded", (("reason", reason),))]
        for reason in DEGRADED_REASONS
    }


def server(cls: Any, probe: Any) -> Any:
    """A router or ingress holding only what its health endpoints use."""
    metrics = RouterMetrics()
    fake = SimpleNamespace(
        _registry_watch=RegistryWatch(probe, metrics),
        _registry_probe=probe,
        _local=SimpleNamespace(metrics=metrics),
    )
    fake.health = lambda: cls.health(fake)
    return fake


def test_the_gauge_starts_healthy_and_follows_the_latest_check() -> None:
    metrics = RouterMetrics()
    assert set(degraded(metrics).values()) == {0}
    metrics.registry_checked("auth")
    assert degraded(metrics) == {r: float(r == "auth") for r in DEGRADED_REASONS}
    metrics.registry_checked("")
    assert set(degraded(metrics).values()) == {0}


@pytest.mark.parametrize("cls", [RouterServer, IngressServer], ids=["direct", "proxy"])
async def test_health_says_degraded_with_the_reason_then_ok(cls: Any) -> None:
    fake = server(cls, _Probe(AUTH, HEALTHY))
    assert await cls.health(fake) == {"status": "degraded", "reason": AUTH.message, "code": "auth"}
    assert degraded(fake._local.metrics)["auth"] == 1
    assert await cls.health(fake) == {"status": "ok"}
    assert degraded(fake._local.metrics)["auth"] == 0


@pytest.mark.parametrize("cls", [RouterServer, IngressServer], ids=["direct", "proxy"])
async def test_serve_s_check_refreshes_the_gauge_and_never_fails(cls: Any) -> None:
    fake = server(cls, _Probe(RegistryHealth("fingerprint", "another cluster's")))
    await cls.check_health(fake)  # degraded: no exception (Serve would restart the router)
    assert fake._registry_probe.checks == 1
    assert degraded(fake._local.metrics)["fingerprint"] == 1
    await cls.check_health(fake)  # even a probe that breaks its promise does not raise


async def test_an_unreachable_configured_registry_is_degraded() -> None:
    environ = {REDIS_URL_ENV: f"redis://127.0.0.1:{free_port()}/0"}  # nothing listens there
    config = load_config(overrides=["registry.backend=redis"], environ=environ)
    probe = make_registry_probe(config)
    assert isinstance(probe, RedisProbe)
    fake = server(RouterServer, probe)
    body = await RouterServer.health(fake)
    assert body["status"] == "degraded" and body["code"] == "unreachable"
    assert environ[REDIS_URL_ENV] in body["reason"]
    assert degraded(fake._local.metrics)["unreachable"] == 1
    await probe.close()
