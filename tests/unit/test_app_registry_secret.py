"""The Serve deployments get the resolved Redis password and API keys inside their config JSON
(the environment of the node that builds the app is read once, there)."""

from __future__ import annotations

import pytest

from prefixmesh.app import build_app
from prefixmesh.config import (
    API_KEYS_ENV,
    REDIS_PASSWORD_ENV,
    REDIS_URL_ENV,
    PrefixmeshConfig,
    load_config,
)

SECRET = "serve-side-secret"


@pytest.mark.parametrize("path", ["direct", "proxy"])
def test_every_deployment_s_config_carries_the_password(path: str) -> None:
    environ = {
        REDIS_URL_ENV: "redis://head:16379/0",
        REDIS_PASSWORD_ENV: SECRET,
        API_KEYS_ENV: "sk-serve-side tenant",
    }
    overrides = [
        f"serving.path={path}",
        "registry.backend=redis",
        "replica.engine=sim",
        "replica.model_path=/nonexistent/model",
    ]
    config = load_config(overrides=overrides, environ=environ)
    app = build_app(config)
    front = app._ingress_request_router if path == "direct" else app
    replicas = front._bound_deployment.init_args[0]
    for config_json in (
        front._bound_deployment.init_args[1],
        replicas._bound_deployment.init_args[0],
    ):
        received = PrefixmeshConfig.model_validate_json(config_json)
        assert received.registry.redis_url == "redis://head:16379/0"
        assert received.registry.redis_password is not None
        assert received.registry.redis_password.get_secret_value() == SECRET
        assert received.auth.api_keys is not None
        assert received.auth.api_keys.get_secret_value() == "sk-serve-side tenant"
