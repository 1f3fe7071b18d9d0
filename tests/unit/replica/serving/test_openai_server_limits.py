"""The direct path's replica refuses before it works (issue 17): a 10 MB body with 413 before
it is read or parsed, a prompt that cannot fit with 400 ``context_length_exceeded`` before it
is tokenized (and one that tokenizes past the context after), ``max_tokens`` over the cap with
400, a request past its time with 504 or an error event; and every error, 404 and 405
included, is OpenAI JSON. The deployment's FastAPI app runs in-process
(``tests/fakes/serve_ingress.py``) over a ``DirectFront`` built through its constructor on a fake
replica whose engine stream the tests choose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from prefixmesh.api import prepare
from prefixmesh.api.auth import ApiKeys
from prefixmesh.api.limits import RequestLimits
from prefixmesh.api.prepare import FrontDoor
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.api.quota import TenantQuotas
from prefixmesh.api.request_metrics import DirectMetrics
from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.cache_registry.registry_health import HEALTHY, RegistryHealth
from prefixmesh.config import load_config
from prefixmesh.metrics.sink import NullSink
from prefixmesh.replica.serving import openai_server
from prefixmesh.replica.serving.direct_front import DirectFront
from prefixmesh.wire import GenerateChunk, GenerateRequest
from tests.fakes.serve_ingress import fast_tokenizer, serve_as, spy
from tests.unit.api.test_errors import openai_error
from tests.unit.router.core.test_metrics import samples

MODEL = "demo-tiny"
TEN_MB = 10_000_000
LIMITS = (
    "replica.vllm.max_model_len=64",
    "limits.max_chars_per_token=4",
    "limits.max_tokens=32",
    "ingress.request_timeout_s=0.2",  # the fake engine below stalls for ever, or answers at once
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fast_tokenizer(tmp_path_factory.mktemp("tok"))


class _Engine:
    """``ReplicaServer.generate``: ``tokens`` chunks, then the end or a stall."""

    def __init__(self, tokens: int = 2, stall: bool = False) -> None:
        self.tokens = tokens
        self.stall = stall
        self.requests: list[GenerateRequest] = []

    async def __call__(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        for i in range(self.tokens):
            last = i == self.tokens - 1 and not self.stall
            yield GenerateChunk((5,), last, "length" if last else None, replica_id="r1")
        if self.stall:
            await asyncio.Event().wait()


class _ServedReplica:
    """The replica under the API: its engine stream (``_Engine``), and what it hears of
    requests refused at the door."""

    replica_id = "r1"

    def __init__(self) -> None:
        self.generate = _Engine()
        self.unserved_ids: list[str] = []

    def unserved(self, request_id: str) -> None:
        self.unserved_ids.append(request_id)

    def registry_health(self) -> RegistryHealth:
        return HEALTHY

    def runtime_registry(self) -> CollectorRegistry:
        return CollectorRegistry()


class Replica:
    """The deployment's app over a ``DirectFront`` (rebuilt by ``serve`` with keys or
    quotas)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, config: Any, tokenizer: Any) -> None:
        self.engine = _ServedReplica()
        encoder = PromptEncoder(tokenizer)
        self._front = FrontDoor(
            config.model,
            RequestLimits.from_config(config, tokenizer),
            encoder,
            make_hasher(config),
        )
        self._decode = encoder.decode
        self._deployment = serve_as(monkeypatch, SimpleNamespace())
        self.serve()
        self.client = TestClient(openai_server.api)

    def serve(
        self,
        keys: ApiKeys | None = None,
        quotas: TenantQuotas | None = None,
        metrics: DirectMetrics | None = None,
    ) -> None:
        """The app's routes on a new front with these keys, quotas and metrics (a Serve
        replica's own by default: none of Ray's, whose replica context is the test's)."""
        metrics = metrics or local_metrics()
        self.http = DirectFront(
            self.engine, self._front, self._decode, metrics=metrics, keys=keys, quotas=quotas
        )
        self._deployment.http = self.http

    @property
    def tokenizer(self) -> Any:
        return self._front.tokenizer

    def post(self, body: Any, path: str = "/v1/completions", **kwargs: Any) -> Any:
        return self.client.post(path, json=body, **kwargs)

    def statuses(self) -> dict[str, float]:
        got = samples(self.http.metrics.render())
        return {
            labels[0][1]: v
            for (name, labels), v in got.items()
            if name.endswith("requests_total") and labels
        }


def local_metrics() -> DirectMetrics:
    """The replica's metrics without Ray's agent (a Ray another test started in this process
    would be asked for the replica context ``serve_as`` made up)."""
    return DirectMetrics(NullSink())


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> Iterator[Replica]:
    served = Replica(monkeypatch, load_config(overrides=list(LIMITS)), tokenizer)
    with served.client:
        yield served


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch, replica: Replica) -> dict[str, list[Any]]:
    """The calls of the parser and the tokenizer, as the replica makes them."""
    encoder = replica.tokenizer
    return {
        "parse": spy(monkeypatch, prepare, "parse_body"),
        "encode": spy(monkeypatch, encoder, "encode"),
        "encode_messages": spy(monkeypatch, encoder, "encode_messages"),
    }


def parsed_and_tokenized(work: dict[str, list[Any]]) -> tuple[int, int]:
    return len(work["parse"]), len(work["encode"]) + len(work["encode_messages"])


def test_a_10_mb_body_is_refused_before_it_is_parsed(
    replica: Replica, work: dict[str, list[Any]]
) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * TEN_MB}).encode()
    error = openai_error(replica.client.post("/v1/completions", content=body), 413)
    assert (error["code"], error["param"]) == ("request_too_large", None)
    assert f"{len(body)} bytes" in error["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "demo-tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1_000_000
        yield b'"}]}'

    chat = replica.client.post("/v1/chat/completions", content=chunked())
    assert openai_error(chat, 413)["code"] == "request_too_large"
    assert parsed_and_tokenized(work) == (0, 0)
    assert replica.statuses() == {"413": 2.0}


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
    replica: Replica, work: dict[str, list[Any]]
) -> None:
    error = openai_error(replica.post({"model": MODEL, "prompt": "x" * 400}), 400)
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "prompt",
        "invalid_request_error",
    )
    assert error["message"].startswith("This model's maximum context length is 64 tokens.")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}
    error = openai_error(replica.post(chat, "/v1/chat/completions"), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    ids = {"model": MODEL, "prompt": [7] * 60, "max_tokens": 8}
    assert openai_error(replica.post(ids), 400)["code"] == "context_length_exceeded"
    assert parsed_and_tokenized(work) == (3, 0)


def test_a_prompt_that_tokenizes_past_the_context_is_400_too(
    replica: Replica, work: dict[str, list[Any]]
) -> None:
    # 40 characters (10 tokens at least by the bound) of 3 bytes each: a byte-level token each.
    prompt = "€" * 40
    error = openai_error(replica.post({"model": MODEL, "prompt": prompt, "max_tokens": 4}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "in the prompt, 4 in the completion" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    error = openai_error(replica.post(chat, "/v1/chat/completions"), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert parsed_and_tokenized(work) == (2, 2)
    assert replica.engine.generate.requests == []


def test_max_tokens_over_the_cap_is_400_and_the_cap_bounds_a_chat_without_one(
    replica: Replica, work: dict[str, list[Any]]
) -> None:
    error = openai_error(replica.post({"model": MODEL, "prompt": "hi", "max_tokens": 33}), 400)
    assert (error["param"], error["code"]) == ("max_tokens", None)
    assert "at most 32 completion tokens" in error["message"]
    assert parsed_and_tokenized(work) == (1, 0)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert replica.post(chat, "/v1/chat/completions").status_code == 200
    (request,) = replica.engine.generate.requests
    assert request.sampling.max_tokens == 32  # not the rest of the 64-token context


def test_unknown_paths_methods_and_fields_are_openai_json(replica: Replica) -> None:
    assert (
        openai_error(replica.client.get("/v1/nope"), 404)["message"] == "Invalid URL (GET /v1/nope)"
    )
    assert openai_error(replica.client.post("/v1/models"), 405)["code"] == "method_not_allowed"
    # A trailing slash is an unknown path (not Starlette's 307 to the path without it).
    slash = replica.client.post("/v1/completions/", follow_redirects=False)
    assert openai_error(slash, 404)["message"] == "Invalid URL (POST /v1/completions/)"
    assert (
        openai_error(replica.client.get("/v1/completions"), 405)["type"] == "invalid_request_error"
    )
    assert openai_error(replica.post({"model": MODEL, "prompt": 3}), 400)["param"] == "prompt"
    bad = {"model": MODEL, "prompt": "hi", "max_tokens": 0}
    assert openai_error(replica.post(bad), 400)["param"] == "max_tokens"
    assert openai_error(replica.post({"model": MODEL, "prompt": [10**6]}), 400)["param"] == "prompt"
    assert openai_error(replica.post({"model": "gpt-4", "prompt": "hi"}), 404)["param"] == "model"


def test_a_request_past_its_time_is_504_or_ends_its_stream(replica: Replica) -> None:
    replica.engine.generate = _Engine(tokens=0, stall=True)  # no first token
    error = openai_error(replica.post({"model": MODEL, "prompt": "hi"}), 504)
    assert (error["type"], error["code"]) == ("server_error", "timeout")
    replica.engine.generate = _Engine(tokens=1, stall=True)  # one token, then nothing
    assert openai_error(replica.post({"model": MODEL, "prompt": "hi"}), 504)["code"] == "timeout"
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with replica.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] is not None
    assert json.loads(events[-2])["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    assert samples(replica.http.metrics.render())[("prefixmesh_stream_errors_total", ())] == 1


def test_a_request_within_its_limits_is_served(replica: Replica) -> None:
    response = replica.post({"model": MODEL, "prompt": "alpha beta", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    body = {"model": MODEL, "prompt": "alpha beta", "max_tokens": 2, "stream": True}
    with replica.client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "error" not in "".join(lines)


def test_with_api_keys_a_request_without_one_is_refused_before_its_body_is_read(
    replica: Replica, work: dict[str, list[Any]], tmp_path: Any
) -> None:
    from prefixmesh.api.auth import ApiKeys

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha team-a\n")
    replica.serve(keys=ApiKeys(keys, ("/health", "/metrics"), 60.0))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    error = openai_error(replica.post(body), 401)
    assert error["code"] == "invalid_api_key"
    assert openai_error(replica.client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert parsed_and_tokenized(work) == (0, 0)
    good = {"Authorization": "Bearer sk-alpha"}
    assert replica.post(body, headers=good).status_code == 200
    assert replica.client.get("/v1/models", headers=good).status_code == 200


def test_a_tenant_over_its_quota_gets_a_429_and_the_router_hears_the_request_ended(
    replica: Replica, tmp_path: Any
) -> None:
    """Issue 17: the key's tenant is checked against its quota once the prompt is tokenized;
    a refused request the router routed here is reported ended, or the router's ledger would
    count it for minutes (as it did for a 401 or 400 before)."""
    from prefixmesh.api.auth import ApiKeys
    from prefixmesh.api.quota import MemoryQuotaStore, TenantQuotas
    from prefixmesh.config import QuotasConfig, TenantQuota
    from prefixmesh.wire.route_ticket import RouteTicket

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha team-a\nsk-beta team-b\n")
    # A 5-token prompt fits once in a minute of 9.
    limits = QuotasConfig(window_s=60, tenants={"team-a": TenantQuota(tokens_per_minute=9)})
    metrics = local_metrics()
    quotas = TenantQuotas(limits, MemoryQuotaStore(), 60.0, metrics)
    replica.serve(ApiKeys(keys, ("/health", "/metrics"), 60.0), quotas, metrics)
    body = {"model": MODEL, "prompt": "alpha beta gamma delta", "max_tokens": 2}
    alpha = {"Authorization": "Bearer sk-alpha"}
    assert replica.post(body, headers=alpha).status_code == 200
    ticket = RouteTicket("cmpl-routed-1", "r1", "affinity", 0, "", 0)
    refused = replica.post(body, headers={**alpha, **ticket.headers()})
    error = openai_error(refused, 429)
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "tokens")
    assert int(refused.headers["retry-after"]) >= 1
    assert replica.engine.unserved_ids == ["cmpl-routed-1"]
    assert replica.post(body, headers={"Authorization": "Bearer sk-beta"}).status_code == 200
    got = samples(replica.http.metrics.render())
    assert got[("prefixmesh_quota_refusals_total", (("limit", "tokens"), ("tenant", "team-a")))]
    completion = (("kind", "completion"), ("tenant", "team-a"))
    assert got[("prefixmesh_tenant_tokens_total", completion)] == 2
    assert replica.statuses()["429"] == 1
