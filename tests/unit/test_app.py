from __future__ import annotations

import pytest

from prefixmesh.app import build_app
from prefixmesh.config import load_config


@pytest.mark.parametrize("path", ["direct", "proxy"])
def test_the_front_deployment_is_health_checked_at_the_configured_period(path: str) -> None:
    # HAProxy drops a dead router from its pool only when Serve's health check notices.
    config = load_config(
        overrides=[
            f"serving.path={path}",
            "replica.engine=sim",
            "replica.model_path=/nonexistent/model",
            "ingress.health_check_period_s=0.5",
        ]
    )
    app = build_app(config)
    front = app._ingress_request_router if path == "direct" else app
    deployment = front._bound_deployment
    assert deployment.name == ("Router" if path == "direct" else "Ingress")
    assert deployment._deployment_config.health_check_period_s == 0.5


def test_replicas_ask_for_the_configured_custom_resources() -> None:
    # How a cluster keeps replicas off the head: only worker nodes offer the resource.
    overrides = ["replica.engine=sim", "replica.model_path=/nonexistent/model"]
    plain = build_app(load_config(overrides=overrides))
    assert "resources" not in plain._bound_deployment.ray_actor_options
    pinned = build_app(load_config(overrides=[*overrides, "replica.resources={gpu_worker: 1}"]))
    options = pinned._bound_deployment.ray_actor_options
    assert options["resources"] == {"gpu_worker": 1.0}
