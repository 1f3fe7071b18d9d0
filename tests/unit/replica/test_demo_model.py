"""The demo model is built offline and deterministically (the same bytes on every machine)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from prefixmesh.replica.demo_model import CHAT_TEMPLATE, ensure_demo_model, make_demo_model

pytestmark = pytest.mark.slow


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_built_twice_it_is_the_same_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    first = make_demo_model(tmp_path / "a", "tiny")
    second = make_demo_model(tmp_path / "b", "tiny")
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert digest(first / name) == digest(second / name), name
    manifest = json.loads((first / "prefixmesh-demo.json").read_text())
    assert manifest["num_parameters"] == 6_555_904
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer("def f(x): return x")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 3
    with pytest.raises(FileExistsError):
        make_demo_model(first, "tiny")


def test_ensure_generates_once(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path, "tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path, "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        make_demo_model(tmp_path / "x", "huge")  # type: ignore[arg-type]


def test_a_configured_model_path_is_used_as_given(tmp_path: Path) -> None:
    from prefixmesh.config import load_config
    from prefixmesh.replica.demo_model import resolve_model_path

    config = load_config(overrides=[f"replica.model_path={tmp_path}"])
    assert resolve_model_path(config) == str(tmp_path)
