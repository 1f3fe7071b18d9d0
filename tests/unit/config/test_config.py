from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prefixmesh.config import (
    ENGINE_BLOCK_SIZES,
    CacheConfig,
    PrefixmeshConfig,
    ReplicaConfig,
    load_config,
    parse_override,
)
from prefixmesh.replica.sim_model.profile import get_profile


def test_defaults_need_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXMESH_CONFIG", raising=False)
    assert load_config() == PrefixmeshConfig()


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "registry:\n  backend: redis\n  lookup_deadline_ms: 3\ncache:\n  block_size: 64\n"
    )
    config = load_config(path, ["registry.lookup_deadline_ms=7", "model=other"])
    assert config.registry.backend == "redis"
    assert config.registry.lookup_deadline_ms == 7
    assert config.cache.block_size == 64
    assert config.model == "other"


def test_unknown_fields_and_bad_values_fail_loudly(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="extra"):
        load_config(overrides=["registry.typo=1"])
    with pytest.raises(ValidationError):
        load_config(overrides=["cache.block_size=0"])
    with pytest.raises(ValueError, match=r"section\.field=value"):
        parse_override("no-equals-sign")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(path)


def test_every_field_is_documented() -> None:
    def walk(model: type[PrefixmeshConfig]) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation)

    walk(PrefixmeshConfig)


def test_liveness_settings_keep_the_5_s_bound() -> None:
    assert load_config(overrides=["registry.dead_after_s=2", "registry.reap_interval_s=0.5"])
    with pytest.raises(ValidationError, match="within 5 s"):
        load_config(overrides=["registry.dead_after_s=4.5"])  # + the 1 s reap interval
    with pytest.raises(ValidationError, match="misses one heartbeat"):
        load_config(overrides=["registry.heartbeat_interval_s=2"])  # dead after 3 s


def test_several_routers_per_node_need_the_shared_registry() -> None:
    with pytest.raises(ValidationError, match=r"routers_per_node > 1 needs"):
        load_config(overrides=["serving.routers_per_node=2"])
    config = load_config(overrides=["serving.routers_per_node=2", "registry.backend=redis"])
    assert config.serving.routers_per_node == 2


def test_an_unset_block_size_follows_the_engine() -> None:
    assert load_config().cache.block_size == 32  # vLLM
    assert load_config(overrides=["replica.engine=sim"]).cache.block_size == 128
    remote = ["replica.engine=remote", "replica.num_replicas=1", "replica.remote.urls=[http://x]"]
    assert load_config(overrides=remote).cache.block_size == 32
    # Set, it is kept whatever the engine; a null in a file is unset.
    h100 = load_config(overrides=["replica.engine=sim", "cache.block_size=16"])
    assert h100.cache.block_size == 16
    assert load_config(overrides=["cache.block_size=null"]).cache.block_size == 32
    # Built from sections, too (a cache section given as settings may leave its size unset).
    built = PrefixmeshConfig.model_validate(
        {"cache": {"hash_seed": 3}, "replica": ReplicaConfig(engine="sim")}
    )
    assert (built.cache.block_size, built.cache.hash_seed) == (128, 3)
    assert PrefixmeshConfig(replica=ReplicaConfig(engine="sim")).cache.block_size == 128
    sized = PrefixmeshConfig(cache=CacheConfig(block_size=64), replica=ReplicaConfig(engine="sim"))
    assert sized.cache.block_size == 64


def test_the_block_size_is_resolved_once_into_an_int() -> None:
    """After validation the section holds an int, never None: a built ``CacheConfig`` needs its
    size, since only the root knows the engine."""
    assert type(load_config(overrides=["cache.block_size=null"]).cache.block_size) is int
    with pytest.raises(ValidationError, match="block_size"):
        CacheConfig()
    with pytest.raises(ValidationError, match="block_size"):
        CacheConfig(block_size=None)  # type: ignore[arg-type]


def test_an_unknown_engine_is_the_only_error_of_an_unset_block_size() -> None:
    for overrides in (["replica.engine=foo"], ["replica.engine=foo", "cache.block_size=null"]):
        with pytest.raises(ValidationError) as raised:
            load_config(overrides=overrides, environ={})
        assert [e["loc"] for e in raised.value.errors()] == [("replica", "engine")]


def test_a_dumped_config_keeps_its_block_size_under_another_engine() -> None:
    """A config handed on (process_json, compare's replica servers) carries the number it
    resolved, so a process that changes the engine (a remote head) hashes as its replicas do."""
    sim = load_config(overrides=["replica.engine=sim"])
    data = sim.model_dump(mode="json")
    data["replica"]["engine"] = "vllm"
    assert PrefixmeshConfig.model_validate(data).cache.block_size == 128


def test_the_sim_default_is_the_default_profiles_block_size() -> None:
    profile = ReplicaConfig().sim.profile
    assert ENGINE_BLOCK_SIZES["sim"] == get_profile(profile).block_size
