"""``prefixmesh serve`` warns at start when the configured registry cannot be used (it serves
anyway, routing on load alone): the reason named, the password never printed."""

from __future__ import annotations

from prefixmesh.config import REDIS_PASSWORD_ENV, REDIS_URL_ENV, load_config
from prefixmesh.ports import free_port
from prefixmesh.serve_cli import registry_warning

SECRET = "n0t-for-the-log"


def test_the_in_process_registry_needs_no_check() -> None:
    assert registry_warning(load_config(environ={})) is None


def test_an_unreachable_redis_is_named() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    environ = {REDIS_URL_ENV: url, REDIS_PASSWORD_ENV: SECRET}
    warning = registry_warning(load_config(overrides=["registry.backend=redis"], environ=environ))
    assert warning is not None
    assert "degraded (unreachable)" in warning and url in warning and "load alone" in warning
    assert SECRET not in warning
