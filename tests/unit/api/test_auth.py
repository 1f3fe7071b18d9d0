"""API keys (issue 17): the keys file (plain and hashed keys, comments, the first malformed
line named), bearer tokens, 401s in OpenAI's words, open paths, and reloads that keep the
previous keys when the new file is bad."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from prefixmesh.api.auth import ApiKeys, KeyFileError, bearer, key_digest, parse_keys
from prefixmesh.api.errors import APIError
from prefixmesh.config import load_config


def test_the_file_holds_plain_and_hashed_keys_and_names_a_bad_line() -> None:
    text = f"# team keys\nsk-alpha team-a\n\n{key_digest('sk-beta')} team-b  \n"
    assert parse_keys(text) == {key_digest("sk-alpha"): "team-a", key_digest("sk-beta"): "team-b"}
    for bad, line in [
        ("sk-a team\nsk-b\n", 2),
        ("sk-a team extra\n", 1),
        ("sk-a te am/x\n", 1),
        ("#\nsha256:abc team\n", 2),
        ("sk-a one\nsk-a two\n", 2),
    ]:
        with pytest.raises(KeyFileError) as raised:
            parse_keys(bad)
        assert raised.value.line == line, bad


def test_a_bearer_token_is_what_the_openai_sdk_sends() -> None:
    assert bearer({"authorization": "Bearer sk-x"}) == "sk-x"
    assert bearer({"authorization": "bearer  sk-x "}) == "sk-x"
    assert bearer({"authorization": "Basic abc"}) is None
    assert bearer({}) is None


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


def test_requests_need_a_known_key_except_on_open_paths(tmp_path: Path) -> None:
    keys = ApiKeys(keys_file(tmp_path, "sk-alpha team-a\n"), ("/health",), 1.0)
    assert asyncio.run(keys.tenant_of("/v1/models", {"authorization": "Bearer sk-alpha"})) == (
        "team-a"
    )
    assert asyncio.run(keys.tenant_of("/health", {})) is None
    for headers in ({}, {"authorization": "Bearer sk-wrong-key"}):
        with pytest.raises(APIError) as raised:
            asyncio.run(keys.tenant_of("/v1/completions", headers))
        assert (raised.value.status, raised.value.code) == (401, "invalid_api_key")
        assert "sk-wrong-key" not in raised.value.message  # never echoed whole


def test_a_changed_file_is_read_again_and_a_bad_one_keeps_the_keys(tmp_path: Path) -> None:
    now = [0.0]
    path = keys_file(tmp_path, "sk-alpha team-a\n")
    keys = ApiKeys(path, (), 1.0, clock=lambda: now[0])
    asyncio.run(keys.tenant_of("/v1/models", {"authorization": "Bearer sk-alpha"}))
    path.write_text("sk-gamma team-c\n")
    os.utime(path, ns=(10**18, 10**18))  # a new mtime even within the clock's resolution
    now[0] = 5.0
    assert asyncio.run(keys.tenant_of("/x", {"authorization": "Bearer sk-gamma"})) == "team-c"
    path.write_text("sk-delta\n")  # malformed: refused whole
    os.utime(path, ns=(2 * 10**18, 2 * 10**18))
    now[0] = 10.0
    assert asyncio.run(keys.tenant_of("/x", {"authorization": "Bearer sk-gamma"})) == "team-c"
    assert keys.reload_errors == 1


def test_keys_are_off_by_default_and_a_bad_file_stops_the_start(tmp_path: Path) -> None:
    assert ApiKeys.from_config(load_config()) is None
    bad = keys_file(tmp_path, "only-a-key\n")
    config = load_config(overrides=[f"auth.api_keys_file={bad}"])
    with pytest.raises(ValueError, match="line 1"):
        ApiKeys.from_config(config)


def test_keys_from_the_environment_count_with_the_file_and_bare_ones_are_default(
    tmp_path: Path,
) -> None:
    environ = {"PREFIXMESH_API_KEYS": f"sk-solo, sk-ops ops\n{key_digest('sk-ci')} ci"}
    keys = ApiKeys.from_config(load_config(environ=environ))
    assert keys is not None and keys.path is None
    for key, tenant in [("sk-solo", "default"), ("sk-ops", "ops"), ("sk-ci", "ci")]:
        assert keys.check({"authorization": f"Bearer {key}"}) == tenant
    path = keys_file(tmp_path, "sk-alpha team-a\n")
    both = load_config(overrides=[f"auth.api_keys_file={path}"], environ=environ)
    keys = ApiKeys.from_config(both)
    assert keys is not None
    assert keys.check({"authorization": "Bearer sk-alpha"}) == "team-a"
    assert keys.check({"authorization": "Bearer sk-solo"}) == "default"
    # Another variable, named in the config.
    named = load_config(overrides=["auth.api_keys_env=MY_KEYS"], environ={"MY_KEYS": "sk-m m"})
    keys = ApiKeys.from_config(named)
    assert keys is not None and keys.check({"authorization": "Bearer sk-m"}) == "m"


def test_bad_environment_keys_stop_the_start_without_showing_them(tmp_path: Path) -> None:
    environ = {"PREFIXMESH_API_KEYS": "sk-secret-one a b"}
    with pytest.raises(ValueError, match=r"\$PREFIXMESH_API_KEYS, entry 1") as raised:
        ApiKeys.from_config(load_config(environ=environ))
    assert "sk-secret-one" not in str(raised.value)
    with pytest.raises(ValueError, match="holds no API key"):
        ApiKeys.from_config(load_config(environ={"PREFIXMESH_API_KEYS": " , # none\n"}))
    # A key in both the file and the variable is refused (which tenant would it name?).
    path = keys_file(tmp_path, "sk-x file-tenant\n")
    config = load_config(
        overrides=[f"auth.api_keys_file={path}"], environ={"PREFIXMESH_API_KEYS": "sk-x env"}
    )
    with pytest.raises(ValueError, match="also in the environment"):
        ApiKeys.from_config(config)


def test_environment_keys_never_come_from_a_file_and_travel_only_in_the_process_json(
    tmp_path: Path,
) -> None:
    from prefixmesh.config import PrefixmeshConfig, process_json

    with pytest.raises(ValueError, match="read from the environment"):
        load_config(overrides={"auth": {"api_keys": "sk-x"}}, environ={})
    config = load_config(environ={"PREFIXMESH_API_KEYS": "sk-travel t"})
    assert "sk-travel" not in repr(config) and "sk-travel" not in config.model_dump_json()
    again = PrefixmeshConfig.model_validate_json(process_json(config))
    assert again.auth.api_keys is not None
    assert again.auth.api_keys.get_secret_value() == "sk-travel t"
