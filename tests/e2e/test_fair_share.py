"""Fair share on a saturated replica (issue 17, item 4), through the direct path with the
openai SDK's keys: a heavy tenant's backlog does not hold a light tenant's request behind it,
and a higher priority starts ahead of both. Asserted on the order requests were answered in
(each answer is one token, so it comes when its prefill is done) and on the replica's counters,
not on times."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from prefixmesh.config import PrefixmeshConfig
from tests.e2e.conftest import Cluster, Deploy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
HEAVY_REQUESTS = 16
PROMPT_TOKENS = 2000
"""Each prompt is prefilled alone under a 2,048-token budget (~0.14 s each at time_scale 2)."""


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(300, 8000) for _ in range(PROMPT_TOKENS)]  # no prefix in common


async def backlog_then(
    cluster: Cluster, late: list[tuple[str, str, dict[str, str]]], waiting: Any
) -> tuple[list[str], int]:
    """Sends the heavy tenant's requests at once, waits until the replica holds a backlog of
    them, then sends ``late`` (name, key, extra headers); returns the names in answer order
    and how many were answered before ``late`` was sent."""
    rng = random.Random(17)
    answered: list[str] = []
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:

        async def send(name: str, key: str, headers: dict[str, str]) -> None:
            body = {"model": MODEL, "prompt": prompt(rng), "max_tokens": 1}
            auth = {"Authorization": f"Bearer {key}", **headers}
            response = await client.post("/v1/completions", json=body, headers=auth)
            assert response.status_code == 200, response.text
            answered.append(name)

        heavy = [
            asyncio.create_task(send(f"heavy{i}", "sk-heavy", {})) for i in range(HEAVY_REQUESTS)
        ]
        for _ in range(600):
            if await asyncio.to_thread(waiting) >= HEAVY_REQUESTS // 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the heavy tenant's backlog never formed at the replica")
        answered_before = len(answered)
        await asyncio.gather(*(send(*request) for request in late), *heavy)
    return answered, answered_before


def test_a_light_tenant_and_an_urgent_request_go_ahead_of_a_heavy_backlog(
    ray_cluster: Cluster, deploy: Deploy, tmp_path_factory: pytest.TempPathFactory
) -> None:
    keys = tmp_path_factory.mktemp("fair") / "keys.txt"
    keys.write_text("sk-heavy heavy\nsk-light light\n")
    config: PrefixmeshConfig = deploy(
        "replica.engine=sim",
        "replica.num_replicas=1",
        "replica.sim.time_scale=2.0",
        "replica.routing_stats_period_s=0.05",
        "replica.fair_share.enabled=true",
        "replica.fair_share.prefill_budget_tokens=2048",
        f"auth.api_keys_file={keys}",
    )
    from ray import serve

    from prefixmesh.app import ROUTER_NAME

    router = serve.get_deployment_handle(ROUTER_NAME, config.app_name)

    def counters() -> dict[str, Any]:
        (stats,) = router.replica_stats.remote().result(timeout_s=30)
        return stats

    late = [
        ("light", "sk-light", {}),
        ("urgent", "sk-heavy", {"x-prefixmesh-priority": "-1"}),
    ]
    order, before = asyncio.run(
        # Until Serve has polled the replica's first report, its stats hold only its id.
        backlog_then(ray_cluster, late, lambda: counters().get("fair_share_waiting", 0))
    )
    assert sorted(order) == sorted(
        [f"heavy{i}" for i in range(HEAVY_REQUESTS)] + ["light", "urgent"]
    )
    # In arrival order both would come after the backlog (at least 8 waiting when they were
    # sent); the urgent one starts first among the waiting, the light tenant next (it has had
    # no service yet). Ahead of them: the heavy request prefilling when they arrived, one whose
    # answer was on its way, and on a loaded machine one more started while they were still
    # on their way to the replica (the hop from client to gate then outlasts a prefill: seen
    # with two busy loops on both cores). Arrival order would put 8 or more ahead.
    heavy_after_sending = {name: order[before : order.index(name)] for name in ("light", "urgent")}
    assert len(heavy_after_sending["urgent"]) <= 3, (before, order)
    assert len(heavy_after_sending["light"]) <= 4, (before, order)
    assert counters()["fair_share_waits"] >= HEAVY_REQUESTS // 2
