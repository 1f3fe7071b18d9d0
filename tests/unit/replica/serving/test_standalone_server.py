"""The standalone replica server with the sim engine, in-process: the OpenAI API with cached
tokens, vLLM's metric names, the endpoints the peer routers call, the cache reset, and the
remote engine's native protocol."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixmesh.api import prepare
from prefixmesh.api.word_vocabulary import Vocabulary
from prefixmesh.cache_registry.hashing import BlockHasher
from prefixmesh.loadtest.compare_report import parse_counters, replica_ttft_p50
from prefixmesh.loadtest.keys import Segment
from prefixmesh.loadtest.prompts import PromptRenderer
from prefixmesh.loadtest.report import prefix_cache_counters
from prefixmesh.replica.serving.engine_server import TTFT_BUCKETS_S
from prefixmesh.replica.serving.standalone_server import (
    ReplicaService,
    build_app,
    make_service,
    parse_args,
    server_config,
)
from tests.fakes.serve_ingress import spy
from tests.unit.api.test_errors import openai_error
from tests.unit.replica.conftest import sim_config

MODEL = "demo-tiny"


@pytest.fixture(scope="module")
def service() -> ReplicaService:
    return make_service(sim_config(), "r7")


@pytest.fixture(scope="module")
def client(service: ReplicaService) -> Iterator[TestClient]:
    with TestClient(build_app(service)) as client:
        yield client


@pytest.fixture(scope="module")
def render(service: ReplicaService) -> PromptRenderer:
    return PromptRenderer(Vocabulary.from_tokenizer_dir(service.model_dir))


def sse(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-prefixmesh-replica"] == "r7"
        return [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def usage_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e["usage"] for e in events if e.get("usage"))


def test_completions_stream_text_and_report_cached_tokens(
    client: TestClient, render: PromptRenderer
) -> None:
    prompt = render.text((Segment(101, 300),))
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = sse(client, "/v1/completions", body)
    choices = [c["choices"][0] for c in first if c["choices"]]
    # The sim's tokens decode as they stream; like vLLM's, the finishing chunk may carry no
    # text when the engine reports the finish after the last tokens went out.
    streamed = [c["text"] for c in choices if c["finish_reason"] is None]
    assert len(streamed) >= 1 and all(streamed), choices
    assert choices[-1]["finish_reason"] == "length"
    assert len("".join(c["text"] for c in choices)) >= 4
    assert usage_of(first) == {
        "prompt_tokens": 301,
        "completion_tokens": 4,
        "total_tokens": 305,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    again = sse(client, "/v1/completions", body)
    assert usage_of(again)["prompt_tokens_details"]["cached_tokens"] == 256  # two full blocks
    # the same prompt as token ids is the same prompt
    ids = render.token_ids((Segment(101, 300),))
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2})
    assert plain.status_code == 200
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert plain.json()["object"] == "text_completion"


def test_chat_stream(client: TestClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse(client, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert usage_of(events)["completion_tokens"] == 3
    full = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"]


def test_metrics_use_vllm_names(client: TestClient, render: PromptRenderer) -> None:
    before = prefix_cache_counters(client.get("/metrics").text)
    ids = render.token_ids((Segment(102, 200),))
    for _ in range(2):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 200
    text = client.get("/metrics").text
    after = prefix_cache_counters(text)
    assert (after[0] - before[0], after[1] - before[1]) == (402, 128)
    assert 'vllm:prefix_cache_hits_total{model_name="demo-tiny",engine="0"}' in text
    assert 'prefixmesh_replica_requests_total{replica="r7"}' in text
    assert "prefixmesh_replica_engine_busy_seconds_total" in text
    counters = parse_counters(text)  # the histogram compare reads the replicas' median from
    assert counters["ttft_count"] >= 2
    assert counters[f"ttft_le:{TTFT_BUCKETS_S[-1]}"] == counters["ttft_count"]
    assert replica_ttft_p50([counters]) is not None


def test_what_vllm_router_asks_for(client: TestClient, render: PromptRenderer) -> None:
    text = render.text((Segment(103, 40),))
    ids = render.token_ids((Segment(103, 40),))
    tokenized = client.post("/tokenize", json={"prompt": text}).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == 41
    assert tokenized["max_model_len"] == 4096
    rendered = client.post("/v1/completions/render", json={"model": MODEL, "prompt": text}).json()
    assert isinstance(rendered, list) and rendered[0]["token_ids"] == ids
    assert client.post("/v1/completions/render", json={"prompt": ids}).json()[0]["token_ids"] == ids
    chat = client.post(
        "/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["token_ids"][0] == 0 and len(chat["token_ids"]) > 3
    decoded = client.post("/detokenize", json={"tokens": ids[1:3]}).json()["prompt"]
    assert text.startswith(decoded) and decoded.count(" ") == 2
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL


def test_what_sglang_router_asks_for(client: TestClient, service: ReplicaService) -> None:
    assert client.get("/health").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["model_path"] == service.model_dir  # a local folder, never a hub id
    assert info["max_total_num_tokens"] == 64 * 128
    assert client.get("/get_model_info").json()["is_generation"] is True
    load = client.get("/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0


def test_the_cache_reset_empties_the_cache(client: TestClient, render: PromptRenderer) -> None:
    ids = render.token_ids((Segment(104, 300),))
    client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    blocks = "prefixmesh_replica_cached_blocks"
    assert f'{blocks}{{replica="r7"}} 0\n' not in client.get("/metrics").text
    for path in ("/reset_prefix_cache", "/flush_cache"):
        assert client.post(path).status_code == 200
        assert f'{blocks}{{replica="r7"}} 0\n' in client.get("/metrics").text
    again = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_errors_are_openai_json(client: TestClient) -> None:
    wrong = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    bad = client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 400
    long = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 5000})
    error = openai_error(long, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert openai_error(client.get("/v1/nope"), 404)["message"] == "Invalid URL (GET /v1/nope)"
    assert openai_error(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"
    assert openai_error(client.post("/v1/completions", json={"model": MODEL}), 400)["param"] == (
        "prompt"
    )


def limited(monkeypatch: pytest.MonkeyPatch, service: ReplicaService, **limits: Any) -> None:
    """``service``'s front door with other limits."""
    front = replace(service.front, limits=replace(service.limits, **limits))
    monkeypatch.setattr(service, "front", front)


def test_limits_come_before_work(
    client: TestClient, service: ReplicaService, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = spy(monkeypatch, prepare, "parse_body")
    tokenized = spy(monkeypatch, service.tokenizer, "encode")
    tokenized_chat = spy(monkeypatch, service.tokenizer, "encode_messages")
    ten_mb = json.dumps({"model": MODEL, "prompt": "x" * 10_000_000}).encode()
    for path in ("/v1/completions", "/tokenize", "/v1/completions/render"):
        assert openai_error(client.post(path, content=ten_mb), 413)["code"] == "request_too_large"
    assert parsed == []
    # The demo tokenizer's longest token has 77 characters: 320,000 cannot fit 4,096 tokens.
    assert service.limits.max_chars_per_token == 77
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 320_000}]}
    error = openai_error(client.post("/v1/chat/completions", json=chat), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    limited(monkeypatch, service, max_tokens=8)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 9}
    assert openai_error(client.post("/v1/completions", json=body), 400)["param"] == "max_tokens"
    assert len(parsed) == 2 and tokenized == tokenized_chat == []
    # A request out of time before its first token (the sim engine computes the prefill).
    limited(monkeypatch, service, timeout_s=0.0)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert openai_error(client.post("/v1/completions", json=body), 504)["code"] == "timeout"


def test_a_prompt_is_hashed_once_on_this_cpu_bound_path(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 37: the front door hashed every prompt for a key nothing here reads
    (the router in front of this server keys prompts itself); the sim engine's own prefix
    cache hashes it once."""
    hashed = spy(monkeypatch, BlockHasher, "hash_tokens")
    body = {"model": MODEL, "prompt": list(range(3, 300)), "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert len(hashed) == 1


def test_the_native_engine_protocol(client: TestClient, service: ReplicaService) -> None:
    info = client.get("/engine/info").json()
    assert info["fingerprint"] == service.fingerprint and info["kv_blocks"] == 64
    assert info["capacity"]["prefill_tokens_per_s"] > 0
    body = {
        "request_id": "n1",
        "prompt_token_ids": list(range(3, 203)),
        "sampling": {"max_tokens": 3},
    }
    with client.stream("POST", "/engine/generate", json=body) as response:
        chunks = [json.loads(line) for line in response.iter_lines() if line]
    assert sum(len(c["token_ids"]) for c in chunks) == 3
    assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "length"


def test_api_keys_guard_the_openai_api_only(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-peer peers\n")
    guarded = make_service(sim_config(f"auth.api_keys_file={keys}"), "r8")
    with TestClient(build_app(guarded)) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET")):
            response = client.request(method, path, json=body if method == "POST" else None)
            assert openai_error(response, 401)["code"] == "invalid_api_key"
        authorized = {"Authorization": "Bearer sk-peer"}
        assert client.post("/v1/completions", json=body, headers=authorized).status_code == 200
        assert client.get("/v1/models", headers=authorized).status_code == 200
        for open_path in ("/health", "/metrics", "/get_server_info"):
            assert client.get(open_path).status_code == 200, open_path


def test_the_servers_block_size_follows_its_engine_unless_set() -> None:
    def block_size(*argv: str) -> int | None:
        return server_config(parse_args(["--port", "1", *argv], "replica-server")).cache.block_size

    assert block_size("--engine", "sim") == 128
    assert block_size("--engine", "vllm") == 32
    assert block_size("--engine", "sim", "--set", "cache.block_size=64") == 64


OUT_OF_VOCABULARY = {
    "message": "prompt token ids out of the vocabulary",
    "type": "invalid_request_error",
    "param": "prompt",
    "code": "invalid_value",
}
"""What every server answers (400) for a token-id prompt the model's tokenizer cannot decode
(``api/prompts.py``)."""


def test_a_token_id_out_of_the_vocabulary_is_refused_as_the_other_servers_refuse_it(
    client: TestClient, service: ReplicaService
) -> None:
    """Regression: the standalone server took token-id prompts as they came (777570c), and
    handed the engine ids its model has no embedding for."""
    size = len(service.tokenizer.hf)
    for ids in ([1, size], [-1, 2]):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
        for stream in (False, True):
            response = client.post("/v1/completions", json={**body, "stream": stream})
            assert openai_error(response, 400) == OUT_OF_VOCABULARY
    within = {"model": MODEL, "prompt": [1, size - 1], "max_tokens": 2}
    assert client.post("/v1/completions", json=within).status_code == 200
