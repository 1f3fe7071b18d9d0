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
