"""The one loader: defaults <- a YAML file <- ``--set`` overrides <- the environment's
registry URL and secrets, validated into a ``PrefixmeshConfig``; and the one dump that carries
the secrets to the cluster's own processes. Nothing else reads config files or the
environment for config."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from prefixmesh.config.base import WITH_SECRETS
from prefixmesh.config.registry import REDIS_PASSWORD_ENV, split_url_password
from prefixmesh.config.root import PrefixmeshConfig
from prefixmesh.config.tenants import API_KEYS_ENV

CONFIG_ENV = "PREFIXMESH_CONFIG"
"""Environment variable naming a YAML config file; read only by ``load_config``."""
REDIS_URL_ENV = "PREFIXMESH_REDIS_URL"
"""Environment variable that, when set, replaces ``registry.redis_url`` (how a cluster points
every process at the head's Redis); read only by ``load_config``."""


def merge_settings(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it, nested sections merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> dict[str, Any]:
    """``registry.backend=redis`` -> ``{"registry": {"backend": "redis"}}`` (value as YAML)."""
    path, sep, raw = text.partition("=")
    if not sep or not path:
        raise ValueError(f"override must look like section.field=value, got {text!r}")
    *sections, field = path.split(".")
    nested: dict[str, Any] = {field: yaml.safe_load(raw)}
    for part in reversed(sections):
        nested = {part: nested}
    return nested


def merge_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``section.field=value`` override applied."""
    merged = dict(data)
    for text in overrides:
        merged = merge_settings(merged, parse_override(text))
    return merged


def _without_secret(
    data: Mapping[str, Any], section: str, secret: str, variable: str, default: str, hint: str = ""
) -> tuple[dict[str, Any], str] | None:
    """``data[section]`` as a new dict, and the name of the environment variable that holds its
    ``secret`` (the setting ``variable``, else ``default``). The secret in the settings
    themselves (a file, ``--set``) is refused. None when the section is not a mapping
    (validation names the mistake)."""
    given = data.get(section, {})
    if not isinstance(given, Mapping):
        return None
    settings = dict(given)
    name = str(settings.get(variable) or default)
    if settings.pop(secret, None) is not None:
        raise ValueError(
            f"{section}.{secret} is read from the environment (${name}), never from a config "
            f"file or an override{hint}"
        )
    return settings, name


def resolve_registry_environment(
    data: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The registry's part of the environment (the one place it is read): $PREFIXMESH_REDIS_URL
    over ``registry.redis_url``, and the password from the variable ``registry.redis_password_env``
    names (else one in the environment's URL). Returns the settings with the URL laid in and
    the password apart: it is added after validation, so no validation error can print it.
    A password in the settings themselves (a file, ``--set``) is refused."""
    found = _without_secret(
        data, "registry", "redis_password", "redis_password_env", REDIS_PASSWORD_ENV
    )
    if found is None:
        return dict(data), None
    registry, name = found
    url = registry.get("redis_url")
    if isinstance(url, str) and split_url_password(url)[1] is not None:
        raise ValueError(
            f"registry.redis_url in a config file or an override carries a password: put it in "
            f"${name} instead"
        )
    password: str | None = None
    env_url = environ.get(REDIS_URL_ENV)
    if env_url:
        registry["redis_url"], password = split_url_password(env_url)
    password = environ.get(name) or password or None
    return {**data, "registry": registry}, password


def resolve_auth_environment(
    data: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The API keys in the variable ``auth.api_keys_env`` names (the one place it is read);
    keys in the settings themselves (a file, ``--set``) are refused."""
    hint = ": use auth.api_keys_file for a file"
    found = _without_secret(data, "auth", "api_keys", "api_keys_env", API_KEYS_ENV, hint)
    if found is None:
        return dict(data), None
    auth, name = found
    return {**data, "auth": auth}, environ.get(name) or None


def process_json(config: PrefixmeshConfig) -> str:
    """The config as JSON for the cluster's own processes (the Serve deployments' arguments):
    the one dump that carries the Redis password (``model_dump_json`` leaves it out)."""
    return config.model_dump_json(context={WITH_SECRETS: True})


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    environ: Mapping[str, str] | None = None,
) -> PrefixmeshConfig:
    """Defaults <- YAML file (``path``, else $PREFIXMESH_CONFIG, else none) <- overrides <- the
    registry's environment ($PREFIXMESH_REDIS_URL, the password: see
    ``resolve_registry_environment``) and the API keys' (``resolve_auth_environment``).
    ``environ``: the environment to read (default: the process's)."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = path or env.get(CONFIG_ENV)
    if source:
        loaded = yaml.safe_load(Path(source).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{source}: the top level must be a mapping")
        data = loaded
    if isinstance(overrides, Mapping):
        data = merge_settings(data, overrides)
    else:
        data = merge_overrides(data, overrides)
    data, password = resolve_registry_environment(data, env)
    data, api_keys = resolve_auth_environment(data, env)
    config = PrefixmeshConfig.model_validate(data)
    # Secrets are laid in after validation, so no validation error can print them.
    if password is not None:
        registry = config.registry.model_copy(update={"redis_password": SecretStr(password)})
        config = config.model_copy(update={"registry": registry})
    if api_keys is not None:
        auth = config.auth.model_copy(update={"api_keys": SecretStr(api_keys)})
        config = config.model_copy(update={"auth": auth})
    return config
