"""Fuzzing the OpenAI API of a running sim cluster (issue 17, "Fuzzing in CI").

Hypothesis generates a fixed, bounded set of requests (``derandomize``, no example database):
OpenAI bodies built from the fields of ``CompletionRequest`` and ``ChatCompletionRequest`` with
values from valid and invalid ranges, JSON that is not a request, bytes that are not JSON, on
the API's paths, unknown paths and wrong methods. Every request goes through HAProxy, the router
and a replica on 127.0.0.1, a few at a time, and every answer must be one a client can handle:
no 5xx, no hang, every 4xx in OpenAI's error JSON, every 200 a JSON body or a complete stream.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from prefixmesh.config import PrefixmeshConfig
from tests.e2e.conftest import Cluster, Deploy
from tests.e2e.test_direct_path import post, router, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
MAX_BODY_BYTES = 65536
MAX_TOKENS = 16
SERVER_TIMEOUT_S = 20
"""The cluster's request timeout: under the client's, so a slow request is the server's 504."""
CLIENT_TIMEOUT_S = 30.0
"""A request unanswered (or a stream unfinished) after this long is a hang."""
REQUESTS = 2000
EXAMPLES = 2050
"""One request per example (a margin over ``REQUESTS``)."""
IN_FLIGHT = 8
BUDGET_S = 150.0
"""The test stops sending after this long, whatever Hypothesis has left (then fails the count)."""

# ---- what Hypothesis generates ---------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=24)
ANY_TEXT = st.text(st.characters(), max_size=12)  # lone surrogates included, rarely
SURROGATE_TEXT = st.builds(
    lambda head, surrogate, tail: head + surrogate + tail,
    TEXT,
    st.characters(categories=["Cs"]),
    TEXT,
)
"""Text with a lone surrogate: JSON escapes it (``\\ud800``), or it is written as bytes that
are not UTF-8."""
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), ANY_TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
WEIRD = st.one_of(
    JSON_VALUES,
    st.sampled_from(
        [0, -1, 10**20, -(10**20), 2**63, 1.5, "NaN", "inf", "1e999", "", "16", [], {}, [[[[]]]]]
    ),
)
NESTED = st.integers(1, 200).map(lambda depth: json.loads("[" * depth + "]" * depth))
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none())},
)
SAMPLING = {
    "max_tokens": st.one_of(st.integers(1, MAX_TOKENS), st.none()),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": st.one_of(st.none(), TEXT, st.lists(st.text(max_size=3), max_size=4)),
    "seed": st.integers(0, 2**31),
    "priority": st.integers(-10, 10),
    "user": TEXT,
    "logprobs": st.sampled_from([None, False, 0]),
    "ignore_eos": st.booleans(),
}
COMPLETION = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(TEXT, st.lists(st.integers(0, 255), min_size=1, max_size=24)),
    },
    optional={**SAMPLING, "echo": st.just(False)},
)
CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=4)},
    optional={**SAMPLING, "max_completion_tokens": st.integers(1, MAX_TOKENS)},
)
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(
        st.sampled_from(["", "nope", f"{MODEL} ", MODEL.upper(), None, 7]), SURROGATE_TEXT
    ),
    "prompt": st.one_of(
        st.lists(TEXT, max_size=3),  # list[str]: not accepted
        st.lists(st.lists(st.integers(0, 255), max_size=3), max_size=3),  # list[list[int]]
        st.lists(st.integers(-(2**40), 2**70), min_size=1, max_size=3),  # outside the vocabulary
        st.sampled_from(["", [], "x" * 20000]),
        SURROGATE_TEXT,
        NESTED,
    ),
    "messages": st.one_of(
        st.sampled_from(
            [
                [],
                [{"content": "x"}],
                [{"role": "robot", "content": "x"}],
                [{"role": "user", "content": 5}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                [{"role": "user", "content": [{"type": "text"}]}],
                "hello",
            ]
        ),
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": SURROGATE_TEXT}),
            min_size=1,
            max_size=2,
        ),
        NESTED,
    ),
    "max_tokens": st.sampled_from([0, -1, MAX_TOKENS + 1, 10**6, 10**20, 1.5, 2.0, "8", True]),
    "max_completion_tokens": st.sampled_from([0, -5, 10**20, 2.5, "x"]),
    "priority": st.sampled_from([10**7, -(10**7), 10**20, 1.5, "1", [], None]),
    "temperature": st.sampled_from([-0.1, 2.5, 1e308, float("nan"), float("inf"), "NaN", "1"]),
    "top_p": st.sampled_from([0, -1, 1.01, float("nan"), float("-inf"), "0.5"]),
    "n": st.sampled_from([0, 2, -1, 10**20, 1.5, "1"]),
    "stream": st.sampled_from(["true", "yes", 1, 2, None, [], {}]),
    "stream_options": st.sampled_from([{"include_usage": "maybe"}, [], "x", {"x": 1}, True]),
    "stop": st.one_of(
        SURROGATE_TEXT, st.lists(ANY_TEXT, max_size=3), st.sampled_from([5, [1, 2], [None], {}])
    ),
    "user": st.one_of(SURROGATE_TEXT, st.sampled_from([5, [], {}])),
    "seed": st.sampled_from([-1, 10**20, -(2**63) - 1, 1.5, "7", float("inf")]),
    "logprobs": st.sampled_from([True, 5, -1, [], "yes"]),
    "echo": st.sampled_from([True, 1, "no"]),
}
FIELDS = sorted(INVALID)


@st.composite
def openai_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A valid request, then none to three mutations: a field set to a value from an invalid
    range, a text field given a lone surrogate, a field deleted, an unknown field added."""
    body = dict(draw(CHAT if chat else COMPLETION))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        mutation = draw(st.sampled_from(["set", "set", "set", "surrogate", "delete", "extra"]))
        if mutation == "delete" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif mutation == "extra":
            body[draw(st.text(min_size=1, max_size=10))] = draw(JSON_VALUES)
        elif mutation == "surrogate":
            text = draw(SURROGATE_TEXT)
            if chat:
                messages = body.get("messages")
                kept = messages if isinstance(messages, list) else []
                body["messages"] = [*kept, {"role": "user", "content": text}]
            else:
                body[draw(st.sampled_from(["prompt", "prompt", "stop", "user"]))] = text
        else:
            key = draw(st.sampled_from(FIELDS))
            body[key] = draw(st.one_of(INVALID[key], WEIRD))
    return body


def _digits(n: int) -> bytes:
    """An integer too long for Python's int parsing (over 4,300 digits)."""
    return b'{"model":"%s","prompt":"x","max_tokens":%s}' % (MODEL.encode(), b"9" * n)


def _deep(depth: int) -> bytes:
    return b'{"model":"%s","prompt":%s%s}' % (MODEL.encode(), b"[" * depth, b"]" * depth)


def _large(size: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x " * (size // 2), "max_tokens": 1}).encode()


RAW = st.one_of(
    st.sampled_from([4301, 5000, 20000]).map(_digits),
    st.sampled_from([1500, 5000, 30000]).map(_deep),
    st.integers(100, 30000).map(_deep),
    st.integers(MAX_BODY_BYTES - 2048, 2 * MAX_BODY_BYTES).map(_large),
    st.sampled_from(
        [b"", b"{", b"null", b"[]", b'"x"', b"1", b"{not json", b"\xff\xfe{}", b"\xef\xbb\xbf{}"]
    ),
    st.binary(max_size=64),
)
API_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health"]
OTHER_PATHS = [
    "/v1/nope",
    "/v1/completions/x",
    "/v1/completions/",
    "/v1/chat/completions?x=1",
    "/",
    "/v1",
    "/internal/route",
    "/v1/%ED%A0%80",
    "/v1/%00",
    "/%2e%2e/etc/passwd",
]
CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json",
    "text/plain",
    None,
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
]


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str
    content: bytes
    content_type: str | None
    chunked: bool

    def describe(self) -> str:
        body = self.content[:300].decode("utf-8", "backslashreplace")
        more = f" ... ({len(self.content)} bytes)" if len(self.content) > 300 else ""
        return f"{self.method} {self.path} [{self.content_type}] {body}{more}"


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON as a client may send it: NaN and Infinity included; a lone surrogate escaped
    (``\\ud800``), or written raw as bytes that are not UTF-8."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def rarely(one_in: int) -> st.SearchStrategy[bool]:
    """True once in ``one_in`` draws (``st.integers`` favours its bounds)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


@st.composite
def fuzz_request(draw: st.DrawFn) -> FuzzRequest:
    shape = draw(st.sampled_from(["completion"] * 4 + ["chat"] * 4 + ["raw", "raw", "json", "get"]))
    if shape in ("completion", "chat"):
        path = "/v1/chat/completions" if shape == "chat" else "/v1/completions"
        if draw(rarely(10)):
            path = draw(st.sampled_from(API_PATHS + OTHER_PATHS))
        content = encode(draw(openai_body(shape == "chat")), draw(st.booleans()))
        method = draw(st.sampled_from(["GET", "PUT"])) if draw(rarely(10)) else "POST"
    elif shape == "get":
        path = draw(st.sampled_from(API_PATHS + OTHER_PATHS))
        method = draw(st.sampled_from(["GET", "GET", "GET", "DELETE", "PUT", "PATCH", "HEAD"]))
        content = b""
    else:
        path = draw(st.sampled_from(API_PATHS[:2] * 3 + OTHER_PATHS))
        method = draw(st.sampled_from(["POST"] * 5 + ["GET", "PUT", "DELETE"]))
        content = draw(RAW) if shape == "raw" else encode(draw(JSON_VALUES), draw(st.booleans()))
    content_type = draw(st.sampled_from(CONTENT_TYPES)) if content else None
    chunked = bool(content) and draw(rarely(20))
    return FuzzRequest(method, path, content, content_type, chunked)


# ---- what every answer must be ---------------------------------------------------------------


def is_openai_error(payload: Any) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|null, "code": str|null}}``."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and "param" in error
        and isinstance(error["param"], str | None)
        and "code" in error
        and isinstance(error["code"], str | None)
    )


def stream_problem(text: str) -> str | None:
    """What is wrong with a server-sent event stream (None: complete): every event JSON (an
    error event in OpenAI's shape), the last one ``[DONE]``."""
    events = [e for e in text.split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return "the stream does not end with data: [DONE]"
    for event in events[:-1]:
        if not event.startswith("data: "):
            return f"not a data event: {event[:80]!r}"
        try:
            payload = json.loads(event[len("data: ") :])
        except ValueError:
            return f"an event is not JSON: {event[:80]!r}"
        if "error" in payload and not is_openai_error(payload):
            return f"an error event is not OpenAI's JSON: {event[:200]!r}"
        if "error" not in payload and "choices" not in payload:
            return f"an event without choices: {event[:200]!r}"
    return None


def answer_problem(request: FuzzRequest, response: httpx.Response, elapsed_s: float) -> str | None:
    """What is wrong with an answer (None: a client can handle it)."""
    status = response.status_code
    if elapsed_s > CLIENT_TIMEOUT_S:
        return f"answered after {elapsed_s:.1f} s"
    if status >= 500:
        return f"{status}: {response.text[:300]!r}"
    if request.method == "HEAD":
        return None if status < 300 or 400 <= status < 500 else f"HEAD got {status}"
    if 400 <= status < 500:
        try:
            payload = response.json()
        except ValueError:
            return f"{status} is not JSON: {response.text[:300]!r}"
        return None if is_openai_error(payload) else f"{status} is not OpenAI's error: {payload}"
    if status != 200:
        return f"unexpected {status}: {response.headers} {response.text[:300]!r}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return stream_problem(response.text)
    try:
        payload = response.json()
    except ValueError:
        return f"200 is not JSON: {response.text[:300]!r}"
    completion = isinstance(payload, dict) and "choices" in payload
    if completion and (not payload["choices"] or "usage" not in payload):
        return f"a completion without choices or usage: {payload}"
    return None


class FuzzRun:
    """Sends requests a few at a time from worker threads and records every answer."""

    def __init__(self, base_url: str) -> None:
        limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
        self._client = httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits)
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="fuzz")
        self._slots = threading.BoundedSemaphore(IN_FLIGHT)
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self.started = time.monotonic()
        self.statuses: Counter[str] = Counter()
        self.problems: list[str] = []
        self.sent = 0
        self.streams = 0

    def out_of_time(self) -> bool:
        return time.monotonic() - self.started > BUDGET_S

    def submit(self, request: FuzzRequest) -> None:
        if self.out_of_time():
            return
        self._slots.acquire()
        self.sent += 1
        self._futures.append(self._pool.submit(self._send, request))

    def _send(self, request: FuzzRequest) -> None:
        try:
            self._exchange(request)
        finally:
            self._slots.release()

    def _exchange(self, request: FuzzRequest) -> None:
        headers = {"content-type": request.content_type} if request.content_type else {}
        content: bytes | Iterator[bytes] = request.content
        if request.chunked:  # Transfer-Encoding: chunked, no Content-Length
            content = iter([request.content[:100], request.content[100:]])
        start = time.monotonic()
        try:
            response = self._client.request(
                request.method, request.path, content=content, headers=headers
            )
        except httpx.HTTPError as exc:
            self._record(request, type(exc).__name__, f"{type(exc).__name__}: {exc}")
            return
        elapsed_s = time.monotonic() - start
        problem = answer_problem(request, response, elapsed_s)
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        self._record(request, str(response.status_code), problem, streamed)

    def _record(
        self, request: FuzzRequest, status: str, problem: str | None, streamed: bool = False
    ) -> None:
        with self._lock:
            self.statuses[status] += 1
            self.streams += streamed
            if problem is not None:
                self.problems.append(f"{problem}\n    <- {request.describe()}")

    def finish(self) -> float:
        for future in self._futures:
            future.result()
        self._pool.shutdown()
        self._client.close()
        return time.monotonic() - self.started


@pytest.fixture(scope="module")
def fuzz_cluster(ray_cluster: Cluster, deploy: Deploy) -> Iterator[Cluster]:
    config: PrefixmeshConfig = deploy(
        "replica.engine=sim",
        "replica.num_replicas=2",
        "replica.max_ongoing_requests=64",
        "replica.routing_stats_period_s=0.25",
        f"serving.max_body_bytes={MAX_BODY_BYTES}",
        f"limits.max_tokens={MAX_TOKENS}",
        f"ingress.request_timeout_s={SERVER_TIMEOUT_S}",
    )
    handle = router(config)
    wait_for(
        lambda: (
            post(ray_cluster, {"model": MODEL, "prompt": "warm up", "max_tokens": 1})
            and handle.counts.remote().result()["routed"] >= 1
        ),
        60,
        "the router's first decision",
    )
    yield ray_cluster


def test_fuzzed_requests_get_answers_a_client_can_handle(fuzz_cluster: Cluster) -> None:
    """Over 2,000 generated requests: no 5xx and no hang (the cluster must refuse bad input, not
    fail on it), every 4xx OpenAI's error JSON (what the openai SDK parses), every 200 a JSON
    body or a stream that ends with ``[DONE]``. Failures are collected, not shrunk: the report
    lists each with the request that caused it."""
    run = FuzzRun(fuzz_cluster.base_url)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzz_request())
    def send(request: FuzzRequest) -> None:
        run.submit(request)

    try:
        send()
    finally:
        wall_s = run.finish()
    print(
        f"\nfuzz: {run.sent} requests in {wall_s:.1f} s ({run.sent / wall_s:.1f}/s), "
        f"{run.streams} streams; statuses {dict(sorted(run.statuses.items()))}"
    )
    kinds = Counter(problem.split(":")[0] for problem in run.problems)
    listed = "\n".join(run.problems[:25])
    assert not run.problems, f"{len(run.problems)} bad answers {dict(kinds)}:\n{listed}"
    assert run.sent >= REQUESTS, f"only {run.sent} requests in the {BUDGET_S:.0f} s budget"
