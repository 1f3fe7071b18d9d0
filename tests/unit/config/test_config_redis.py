"""The registry's environment: $PREFIXMESH_REDIS_URL over the file and overrides, the password
from the variable ``registry.redis_password_env`` names (never from a file), TLS settings only
with rediss://, and the password kept out of reprs, URLs and error messages. Every test passes
its environment in; none reads or changes the process's."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prefixmesh.config import (
    REDIS_PASSWORD_ENV,
    REDIS_URL_ENV,
    PrefixmeshConfig,
    load_config,
    process_json,
    split_url_password,
)

SECRET = "s3cr3t-Pa55"
REDIS = ["registry.backend=redis"]


def test_no_environment_keeps_the_configured_url_and_no_password() -> None:
    config = load_config(overrides=REDIS, environ={})
    assert config.registry.redis_url == "redis://127.0.0.1:16379/0"
    assert config.registry.redis_password is None
    assert config.registry.redis_password_env == REDIS_PASSWORD_ENV == "PREFIXMESH_REDIS_PASSWORD"
    assert REDIS_URL_ENV == "PREFIXMESH_REDIS_URL"


def test_the_environment_url_wins_over_the_file_and_the_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("registry:\n  backend: redis\n  redis_url: redis://file-host:1/0\n")
    environ = {REDIS_URL_ENV: "rediss://head.cluster:6380/2"}
    config = load_config(path, ["registry.redis_url=redis://cli-host:2/0"], environ=environ)
    assert config.registry.redis_url == "rediss://head.cluster:6380/2"
    assert config.registry.redis_tls
    empty = load_config(path, environ={REDIS_URL_ENV: ""})  # set but empty: not an override
    assert empty.registry.redis_url == "redis://file-host:1/0"


def test_the_password_comes_from_the_named_variable() -> None:
    config = load_config(overrides=REDIS, environ={REDIS_PASSWORD_ENV: SECRET})
    assert config.registry.redis_password is not None
    assert config.registry.redis_password.get_secret_value() == SECRET

    renamed = [*REDIS, "registry.redis_password_env=MY_REDIS_PW"]
    config = load_config(
        overrides=renamed, environ={"MY_REDIS_PW": SECRET, REDIS_PASSWORD_ENV: "x"}
    )
    assert config.registry.redis_password is not None
    assert config.registry.redis_password.get_secret_value() == SECRET
    assert (
        load_config(overrides=REDIS, environ={REDIS_PASSWORD_ENV: ""}).registry.redis_password
        is None
    )


def test_a_password_in_the_environment_url_is_moved_out_of_it() -> None:
    environ = {REDIS_URL_ENV: "redis://app:p%40ss@head:16379/0"}
    config = load_config(overrides=REDIS, environ=environ)
    assert config.registry.redis_url == "redis://app@head:16379/0"  # the user name stays
    assert config.registry.redis_password is not None
    assert config.registry.redis_password.get_secret_value() == "p@ss"
    # The password variable wins over the URL's.
    environ[REDIS_PASSWORD_ENV] = SECRET
    config = load_config(overrides=REDIS, environ=environ)
    assert config.registry.redis_password is not None
    assert config.registry.redis_password.get_secret_value() == SECRET


def test_a_password_in_a_file_or_an_override_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"registry:\n  redis_password: {SECRET}\n")
    with pytest.raises(
        ValueError, match=r"from the environment \(\$PREFIXMESH_REDIS_PASSWORD\)"
    ) as exc:
        load_config(path, environ={})
    assert SECRET not in str(exc.value)
    with pytest.raises(ValueError, match="carries a password") as exc:
        load_config(overrides=[f"registry.redis_url=redis://:{SECRET}@h:1/0"], environ={})
    assert SECRET not in str(exc.value)


def test_the_password_never_shows_in_reprs_or_validation_errors() -> None:
    environ = {REDIS_PASSWORD_ENV: SECRET, REDIS_URL_ENV: f"redis://:{SECRET}x@h:1/0"}
    config = load_config(overrides=REDIS, environ=environ)
    assert SECRET not in repr(config) and SECRET not in str(config)
    assert SECRET not in repr(config.registry) and SECRET not in config.registry.redis_url
    assert SECRET not in str(config.model_dump())
    # An invalid config with a password in the environment: the error does not print it.
    with pytest.raises(ValidationError) as exc:
        load_config(overrides=[*REDIS, "registry.dead_after_s=10"], environ=environ)
    assert SECRET not in str(exc.value)
    with pytest.raises(ValidationError, match="redis:// or rediss://") as exc:
        load_config(overrides=REDIS, environ={REDIS_URL_ENV: f"http://:{SECRET}@h:1/0"})
    assert SECRET not in str(exc.value)


def test_the_password_travels_only_in_the_process_json() -> None:
    # Serve's processes get the config as JSON (app.py): the password must survive that dump,
    # and no other (a report or a YAML file written from a dump).
    config = load_config(overrides=REDIS, environ={REDIS_PASSWORD_ENV: SECRET})
    again = PrefixmeshConfig.model_validate_json(process_json(config))
    assert again == config
    assert again.registry.redis_password is not None
    assert again.registry.redis_password.get_secret_value() == SECRET
    assert SECRET not in config.model_dump_json()
    dumped = config.model_dump(mode="json")
    assert dumped["registry"]["redis_password"] is None
    assert load_config(overrides=dumped, environ={}).registry.redis_password is None
    assert process_json(load_config(environ={})) == load_config(environ={}).model_dump_json()


def test_tls_settings_need_rediss_and_come_in_pairs() -> None:
    ca = "registry.redis_tls_ca_file=/etc/ca.pem"
    with pytest.raises(ValidationError, match="need a rediss://"):
        load_config(overrides=[*REDIS, ca], environ={})
    tls = {REDIS_URL_ENV: "rediss://h:6380/0"}
    config = load_config(overrides=[*REDIS, ca, "registry.redis_tls_verify=false"], environ=tls)
    assert (config.registry.redis_tls_ca_file, config.registry.redis_tls_verify) == (
        "/etc/ca.pem",
        False,
    )
    with pytest.raises(ValidationError, match="go together"):
        load_config(overrides=[*REDIS, "registry.redis_tls_cert_file=/c.pem"], environ=tls)
    with pytest.raises(ValidationError, match="redis:// or rediss://"):
        load_config(overrides=["registry.redis_url=unix:///tmp/redis.sock"], environ={})


def test_split_url_password() -> None:
    assert split_url_password("redis://h:1/0") == ("redis://h:1/0", None)
    assert split_url_password("rediss://:pw@h:1/0") == ("rediss://h:1/0", "pw")
    assert split_url_password("redis://u:a%2Fb@h/0") == ("redis://u@h/0", "a/b")
    assert split_url_password("redis://u@h/0") == ("redis://u@h/0", None)
