"""The proxy path's ingress refuses before it works (issue 17): a 10 MB body with 413 before it
is read or parsed, a prompt that cannot fit with 400 ``context_length_exceeded`` before it is
tokenized (and one that tokenizes past the context after), ``max_tokens`` over the cap with 400,
a request past its time (retries and streams included) with 504 or an error event; every error,
404 and 405 included, is OpenAI JSON. Its FastAPI app runs in-process on an instance built
without Serve, with a fake replica handle."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixmesh import tracing
from prefixmesh.api import prepare
from prefixmesh.config import load_config
from prefixmesh.router.front import ingress
from prefixmesh.router.front.ingress import IngressServer
from prefixmesh.wire import GenerateChunk, GenerateRequest
from tests.fakes.serve_ingress import build, model_folder, spy
from tests.unit.api.test_errors import openai_error
from tests.unit.router.core.test_metrics import samples

MODEL = "demo-tiny"
LIMITS = (
    "replica.vllm.max_model_len=64",
    "limits.max_chars_per_token=4",
    "limits.max_tokens=32",
    "ingress.request_timeout_s=0.2",  # the fake replicas below stall for ever, or answer at once
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(tmp_path_factory.mktemp("tok"))


class _Stream:
    """A replica's stream as the handle returns it: ``tokens`` chunks, then the end or a
    stall."""

    def __init__(self, tokens: int, stall: bool) -> None:
        self.left = tokens
        self.stall = stall
        self.cancelled = False

    async def __anext__(self) -> GenerateChunk:
        if self.left:
            self.left -= 1
            last = not self.left and not self.stall
            return GenerateChunk((5,), last, "length" if last else None, replica_id="r1")
        if self.stall:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _Replicas:
    """Serve's handle: ``options(stream=True).generate.remote(request)``."""

    def __init__(self, tokens: int = 2, stall: bool = False) -> None:
        self.tokens = tokens
        self.stall = stall
        self.requests: list[GenerateRequest] = []
        self.streams: list[_Stream] = []

    def options(self, stream: bool) -> Any:
        return SimpleNamespace(generate=SimpleNamespace(remote=self._remote))

    def _remote(self, request: GenerateRequest) -> _Stream:
        self.requests.append(request)
        self.streams.append(_Stream(self.tokens, self.stall))
        return self.streams[-1]


class Ingress:
    def __init__(self, server: Any, client: TestClient, work: dict[str, list[Any]]) -> None:
        self.server = server
        self.client = client
        self.work = work

    def post(self, body: Any, path: str = "/v1/completions") -> Any:
        return self.client.post(path, json=body)

    def parsed_and_tokenized(self) -> tuple[int, int]:
        tokenized = len(self.work["encode"]) + len(self.work["encode_messages"])
        return len(self.work["parse"]), tokenized

    def statuses(self) -> dict[str, float]:
        got = samples(self.server._metrics.render())
        return {
            labels[0][1]: value
            for (name, labels), value in got.items()
            if name == "prefixmesh_requests_total" and labels
        }


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch, model: Path) -> Iterator[Ingress]:
    # An app name of its own: the router's in-process state is one per app and process.
    config = load_config(overrides=[*LIMITS, f"app_name=test-{uuid.uuid4().hex}"])
    server = build(monkeypatch, IngressServer, _Replicas(), config.model_dump_json(), str(model))
    encoder = server._front.tokenizer
    work = {
        "parse": spy(monkeypatch, prepare, "parse_body"),
        "encode": spy(monkeypatch, encoder, "encode"),
        "encode_messages": spy(monkeypatch, encoder, "encode_messages"),
    }
    try:
        with TestClient(ingress.api) as client:
            yield Ingress(server, client, work)
    finally:
        tracing.reset()  # the constructor set tracing up (off) for the process


def test_a_10_mb_body_is_refused_before_it_is_parsed(proxy: Ingress) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * 10_000_000}).encode()
    error = openai_error(proxy.client.post("/v1/completions", content=body), 413)
    assert (error["code"], error["param"]) == ("request_too_large", None)

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "demo-tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1_000_000
        yield b'"}'

    chunks = proxy.client.post("/v1/chat/completions", content=chunked())
    assert openai_error(chunks, 413)["code"] == "request_too_large"
    assert proxy.parsed_and_tokenized() == (0, 0)
    assert proxy.statuses() == {"413": 2.0}


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(proxy: Ingress) -> None:
    error = openai_error(proxy.post({"model": MODEL, "prompt": "x" * 400}), 400)
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "prompt",
        "invalid_request_error",
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}
    error = openai_error(proxy.post(chat, "/v1/chat/completions"), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert proxy.parsed_and_tokenized() == (2, 0)
    # past the context once tokenized: the same error, after the tokenizer
    error = openai_error(proxy.post({"model": MODEL, "prompt": "€" * 40, "max_tokens": 4}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert proxy.parsed_and_tokenized() == (3, 1)
    assert proxy.server._replicas.requests == []


def test_max_tokens_over_the_cap_is_400_and_the_cap_bounds_a_chat_without_one(
    proxy: Ingress,
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = openai_error(
        proxy.post({**body, "max_completion_tokens": 33}, "/v1/chat/completions"), 400
    )
    assert (error["param"], error["code"]) == ("max_completion_tokens", None)
    assert proxy.parsed_and_tokenized() == (1, 0)
    assert proxy.post(body, "/v1/chat/completions").status_code == 200
    (request,) = proxy.server._replicas.requests
    assert request.sampling.max_tokens == 32  # not the rest of the 64-token context


def test_unknown_paths_methods_and_fields_are_openai_json(proxy: Ingress) -> None:
    assert (
        openai_error(proxy.client.get("/v1/nope"), 404)["message"] == "Invalid URL (GET /v1/nope)"
    )
    assert openai_error(proxy.client.delete("/v1/models"), 405)["code"] == "method_not_allowed"
    slash = proxy.client.get("/v1/models/", follow_redirects=False)  # no 307 to /v1/models
    assert openai_error(slash, 404)["message"] == "Invalid URL (GET /v1/models/)"
    assert openai_error(proxy.client.get("/v1/chat/completions"), 405)["param"] is None
    assert openai_error(proxy.post({"model": MODEL, "prompt": 3}), 400)["param"] == "prompt"
    bad = {"model": MODEL, "messages": []}
    assert openai_error(proxy.post(bad, "/v1/chat/completions"), 400)["param"] == "messages"
    assert openai_error(proxy.post({"model": "gpt-4", "prompt": "hi"}), 404)["param"] == "model"


def test_a_request_past_its_time_is_504_or_ends_its_stream(proxy: Ingress) -> None:
    replicas = proxy.server._replicas = _Replicas(tokens=0, stall=True)  # no first token
    error = openai_error(proxy.post({"model": MODEL, "prompt": "hi"}), 504)
    assert (error["type"], error["code"]) == ("server_error", "timeout")
    assert replicas.streams[0].cancelled  # the replica aborts it
    replicas = proxy.server._replicas = _Replicas(tokens=1, stall=True)  # a token, then nothing
    assert openai_error(proxy.post({"model": MODEL, "prompt": "hi"}), 504)["code"] == "timeout"
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with proxy.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert "choices" in json.loads(events[0])
    assert json.loads(events[-2])["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    assert all(stream.cancelled for stream in replicas.streams)
    assert samples(proxy.server._metrics.render())[("prefixmesh_stream_errors_total", ())] == 1


def test_a_request_within_its_limits_is_served(proxy: Ingress) -> None:
    response = proxy.post({"model": MODEL, "prompt": "alpha beta", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    body = {"model": MODEL, "prompt": "alpha beta", "max_tokens": 2, "stream": True}
    with proxy.client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "error" not in "".join(lines)


def test_with_api_keys_the_proxy_path_wants_one_before_it_reads_the_body(
    proxy: Ingress, tmp_path: Any
) -> None:
    from prefixmesh.api.auth import ApiKeys

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha team-a\n")
    proxy.server._keys = ApiKeys(keys, ("/health", "/metrics"), 60.0)
    body = {"model": MODEL, "prompt": "alpha beta", "max_tokens": 2}
    assert openai_error(proxy.post(body), 401)["code"] == "invalid_api_key"
    assert openai_error(proxy.client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert proxy.parsed_and_tokenized() == (0, 0)
    good = {"Authorization": "Bearer sk-alpha"}
    assert proxy.client.post("/v1/completions", json=body, headers=good).status_code == 200
    assert proxy.statuses().get("401") == 1


def test_quotas_on_the_proxy_path_refuse_over_quota_and_settle_the_completion(
    proxy: Ingress, tmp_path: Any
) -> None:
    """Issue 17: the ingress checks the key's tenant against its quota after tokenizing, and
    counts a request's completion when it ends (streamed or not), once whatever the retries."""
    from prefixmesh.api.auth import ApiKeys
    from prefixmesh.api.quota import MemoryQuotaStore, TenantQuotas
    from prefixmesh.config import QuotasConfig, TenantQuota
    from tests.unit.router.core.test_metrics import samples

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha team-a\n")
    server = proxy.server
    server._keys = ApiKeys(keys, ("/health", "/metrics"), 60.0)
    limits = QuotasConfig(window_s=60, default=TenantQuota(tokens_per_minute=18))  # two 5-token
    server._quotas = TenantQuotas(limits, MemoryQuotaStore(), 60.0, server._metrics)
    alpha = {"Authorization": "Bearer sk-alpha"}
    body = {"model": MODEL, "prompt": "alpha beta gamma delta", "max_tokens": 2}
    assert proxy.client.post("/v1/completions", json=body, headers=alpha).status_code == 200
    with proxy.client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=alpha
    ) as response:
        assert response.status_code == 200
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
    # A bad priority is refused before the quota is charged (a 400 left its prompt counted).
    bad = proxy.client.post(
        "/v1/completions", json=body, headers={**alpha, "x-prefixmesh-priority": "high"}
    )
    assert openai_error(bad, 400)["param"] == "priority"
    # 5 + 2 + 5 + 2 = 14 used: a third 5-token prompt does not fit in 18.
    refused = proxy.client.post("/v1/completions", json=body, headers=alpha)
    assert openai_error(refused, 429)["code"] == "rate_limit_exceeded"
    assert "Used 14" in openai_error(refused, 429)["message"]
    got = samples(server._metrics.render())
    tokens = {
        kind: got[("prefixmesh_tenant_tokens_total", (("kind", kind), ("tenant", "team-a")))]
        for kind in ("prompt", "completion")
    }
    assert tokens == {"prompt": 10, "completion": 4}


def test_a_prompt_refused_after_tokenizing_is_not_charged_to_its_tenant(
    proxy: Ingress, tmp_path: Any
) -> None:
    """Regression: the proxy path charged a prompt to its tenant's quota before it found the
    prompt past the context (777570c: sampling came after the quota), a 400 that still counted;
    the front door refuses it before the quota, as the direct path's replica always did."""
    from prefixmesh.api.auth import ApiKeys
    from prefixmesh.api.quota import MemoryQuotaStore, TenantQuotas
    from prefixmesh.config import QuotasConfig, TenantQuota

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha team-a\n")
    server = proxy.server
    server._keys = ApiKeys(keys, ("/health", "/metrics"), 60.0)
    limits = QuotasConfig(window_s=60, default=TenantQuota(tokens_per_minute=1000))
    server._quotas = TenantQuotas(limits, MemoryQuotaStore(), 60.0, server._metrics)
    alpha = {"Authorization": "Bearer sk-alpha"}
    body = {"model": MODEL, "prompt": "€" * 40, "max_tokens": 4}  # fits until tokenized
    error = openai_error(proxy.client.post("/v1/completions", json=body, headers=alpha), 400)
    assert error["code"] == "context_length_exceeded"
    assert proxy.parsed_and_tokenized() == (1, 1)
    charged = [name for name, _ in samples(server._metrics.render()) if "tenant_tokens" in name]
    assert charged == []
