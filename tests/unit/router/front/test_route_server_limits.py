"""The direct path's router spends nothing on input its replica will refuse (issue 17): a body
HAProxy marked truncated is not read, one over ``limits.max_body_bytes`` is not parsed, and a
prompt that cannot fit the context (or a ``max_tokens`` over the cap) is not tokenized; each
gets a load-balanced pick (never an error: HAProxy would answer 503). Its other paths answer
OpenAI JSON. The router's FastAPI app runs in-process on an instance its constructor built,
with a fake replica handle and without Serve."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixmesh import tracing
from prefixmesh.api import prepare
from prefixmesh.config import load_config
from prefixmesh.router.front import route_server
from prefixmesh.router.front.route_server import TRUNCATED_HEADER, RouterServer
from tests.fakes.serve_ingress import build, model_folder, spy
from tests.unit.api.test_errors import openai_error
from tests.unit.router.front.test_route_server import _Replicas

MODEL = "demo-tiny"
LIMITS = (
    "replica.vllm.max_model_len=64",
    "limits.max_chars_per_token=4",
    "limits.max_tokens=32",
    "limits.max_body_bytes=65536",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("tok"))


class Router:
    def __init__(self, server: Any, client: TestClient, work: dict[str, list[Any]]) -> None:
        self.server = server
        self.client = client
        self.work = work
        self.fell_back: list[tuple[Any, ...]] = []

    def route(self, body: Any, headers: dict[str, str] | None = None) -> dict[str, Any]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = self.client.post("/internal/route", content=content, headers=headers)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def parsed_and_tokenized(self) -> tuple[int, int]:
        tokenized = len(self.work["encode"]) + len(self.work["encode_messages"])
        return len(self.work["parse"]), tokenized


class _Handle(_Replicas):
    """The replica handle, as the router's constructor finds it (``_init`` builds its request
    router)."""

    initialized = False

    def _init(self) -> None:
        self.initialized = True


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch, model: Path) -> Iterator[Router]:
    # An app name of its own: the router's in-process state is one per app and process.
    overrides = [*LIMITS, "serving.router_timeout_s=10", f"app_name=test-{uuid.uuid4().hex}"]
    config = load_config(overrides=overrides)
    handle = _Handle("r1", "r1")
    server = build(monkeypatch, RouterServer, handle, config.model_dump_json(), str(model))
    handle.local = server._local  # the state the router's request router shares with it
    assert handle.initialized and server._budget_s == 5.0
    encoder = server._front.tokenizer
    fell_back = spy(monkeypatch, server._local.metrics, "fell_back")
    work = {
        "parse": spy(monkeypatch, prepare, "parse_body"),
        "encode": spy(monkeypatch, encoder, "encode"),
        "encode_messages": spy(monkeypatch, encoder, "encode_messages"),
    }
    try:
        with TestClient(route_server.api) as client:
            routed = Router(server, client, work)
            routed.fell_back = fell_back
            yield routed
    finally:
        tracing.reset()  # the constructor set tracing up (off) for the process


def balanced(answer: dict[str, Any]) -> bool:
    """A pick on load alone: a replica, and no ticket."""
    return answer == {"replica_id": "SERVE_REPLICA::app#r#r1"}


def test_a_body_over_the_limit_is_balanced_without_parsing(router: Router) -> None:
    ten_mb = json.dumps({"model": MODEL, "prompt": "x" * 10_000_000}).encode()
    assert balanced(router.route(ten_mb))
    # As HAProxy forwards it: the first bytes and the mark, which is not read at all.
    truncated = {TRUNCATED_HEADER: f"65536/{len(ten_mb)}"}
    assert balanced(router.route(ten_mb[:65536], truncated))
    assert router.parsed_and_tokenized() == (0, 0)
    assert (router.server.fallbacks, router.fell_back) == (2, [])  # no error, no timeout


def test_a_prompt_that_cannot_fit_is_balanced_without_tokenizing(router: Router) -> None:
    assert balanced(router.route({"model": MODEL, "prompt": "x" * 400}))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}
    assert balanced(router.route(chat))
    assert balanced(router.route({"model": MODEL, "prompt": "hi", "max_tokens": 33}))
    assert router.parsed_and_tokenized() == (3, 0)
    # past the context once tokenized: balanced too (the replica answers the 400)
    assert balanced(router.route({"model": MODEL, "prompt": "€" * 40, "max_tokens": 4}))
    assert router.parsed_and_tokenized() == (4, 1)


def test_a_prompt_within_the_limits_is_routed_with_a_ticket(router: Router) -> None:
    answer = router.route({"model": MODEL, "prompt": "alpha beta", "max_tokens": 4})
    assert answer["replica_id"] == "SERVE_REPLICA::app#r#r1" and answer["request_headers"]
    assert router.parsed_and_tokenized() == (1, 1) and router.server.routed == 1


def test_its_other_paths_answer_openai_json(router: Router) -> None:
    assert openai_error(router.client.get("/internal/route"), 405)["code"] == "method_not_allowed"
    error = openai_error(router.client.get("/v1/nope"), 404)
    assert error["message"] == "Invalid URL (GET /v1/nope)"
