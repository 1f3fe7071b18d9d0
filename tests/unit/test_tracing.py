"""prefixmesh.tracing with the SDK's in-memory exporter (and a loopback OTLP receiver): no Ray."""

from __future__ import annotations

import http.server
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
from opentelemetry import trace

from prefixmesh import tracing
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.config import TelemetryConfig
from prefixmesh.wire import GenerateRequest, SamplingSettings

MEMORY = TelemetryConfig(tracing="memory")


@pytest.fixture(autouse=True)
def fresh_tracing() -> Iterator[None]:
    tracing.reset()
    yield
    tracing.reset()


def test_tracing_none_records_nothing() -> None:
    tracing.setup(TelemetryConfig(), "ingress")
    assert not tracing.enabled()
    assert isinstance(tracing.tracer(), trace.NoOpTracer)
    span = tracing.tracer().start_span("x")
    assert not span.is_recording()
    span.end()
    assert tracing.finished_spans() == []


def test_before_setup_the_tracer_is_the_noop_one() -> None:
    assert not tracing.enabled()
    assert isinstance(tracing.tracer(), trace.NoOpTracer)


def test_context_survives_a_pickled_generate_request() -> None:
    tracing.setup(MEMORY, "ingress")
    parent = tracing.tracer().start_span("prefixmesh.request")
    request = GenerateRequest(
        "r1",
        (1, 2, 3),
        PrefixKey((), 16),
        SamplingSettings(4),
        trace_context=tracing.inject(parent),
    )
    parent.end()

    arrived: GenerateRequest = pickle.loads(pickle.dumps(request))
    child = tracing.tracer().start_span("child", context=tracing.extract(arrived.trace_context))
    child.end()

    spans = {s["name"]: s for s in tracing.finished_spans()}
    assert spans["child"]["parent_span_id"] == spans["prefixmesh.request"]["span_id"]
    assert spans["child"]["trace_id"] == spans["prefixmesh.request"]["trace_id"]
    assert spans["child"]["role"] == "ingress"


def test_extract_of_nothing_makes_a_root() -> None:
    tracing.setup(MEMORY, "replica")
    assert tracing.extract(None) is None
    assert tracing.extract({}) is None
    span = tracing.tracer().start_span("root", context=tracing.extract({"traceparent": "junk"}))
    span.end()
    assert tracing.finished_spans()[0]["parent_span_id"] is None


def test_span_context_names_a_carrier_s_span_or_none() -> None:
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    context = tracing.span_context(carrier)
    assert context is not None and context.is_remote
    assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
    )
    assert tracing.span_context(None) is None
    assert tracing.span_context({}) is None
    assert tracing.span_context({"traceparent": "junk"}) is None
    zero = {"traceparent": f"00-{'0' * 32}-b7ad6b7169203331-01"}  # an invalid trace id
    assert tracing.span_context(zero) is None


def test_setup_is_idempotent_the_first_config_wins() -> None:
    tracing.setup(MEMORY, "ingress")
    tracer = tracing.tracer()
    tracing.setup(TelemetryConfig(), "router")
    assert tracing.enabled() and tracing.tracer() is tracer


def test_finished_spans_can_be_cleared() -> None:
    tracing.setup(MEMORY, "replica")
    tracing.tracer().start_span("a").end()
    assert [s["name"] for s in tracing.finished_spans(clear=True)] == ["a"]
    assert tracing.finished_spans() == []


def test_sample_ratio_zero_follows_a_sampled_caller() -> None:
    tracing.setup(TelemetryConfig(tracing="memory", sample_ratio=0.0), "ingress")
    tracing.tracer().start_span("new trace").end()
    assert tracing.finished_spans() == []
    caller = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    tracing.tracer().start_span("continued", context=tracing.extract(caller)).end()
    (span,) = tracing.finished_spans()
    assert span["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert span["parent_span_id"] == "b7ad6b7169203331"


class _Receiver(http.server.BaseHTTPRequestHandler):
    posts: ClassVar[list[tuple[str, str, int]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        self.rfile.read(length)
        self.posts.append((self.path, self.headers.get("content-type", ""), length))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_exports_to_the_configured_endpoint() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        tracing.setup(TelemetryConfig(tracing="otlp", otlp_endpoint=endpoint), "replica")
        tracing.tracer().start_span("exported").end()
        assert tracing.force_flush()
    finally:
        server.shutdown()
        server.server_close()
    assert _Receiver.posts and _Receiver.posts[0][0] == "/v1/traces"
    assert _Receiver.posts[0][1] == "application/x-protobuf"
    assert tracing.finished_spans() == []  # nothing kept in memory


def test_the_otlp_exporter_is_imported_only_for_otlp() -> None:
    code = (
        "import sys\n"
        "from prefixmesh import tracing\n"
        "from prefixmesh.config import TelemetryConfig\n"
        "tracing.setup(TelemetryConfig(tracing='memory'), 'x')\n"
        "print(any(m.startswith('opentelemetry.exporter') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
