"""The front door's /metrics is the node's view when the agent's port is known, the replica's
own without it or while the agent fails; the agent is read over HTTP on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prefixmesh.replica.serving.node_metrics import RayAgentMetrics, node_metrics, node_or_own

AGENT_TEXT = 'ray_prefixmesh_requests_total{ReplicaId="a"} 3.0\n'


class Failing:
    async def text(self) -> str:
        raise ConnectionError("agent restarting")


class Agent(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = AGENT_TEXT.encode() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def agent_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def test_the_node_s_agent_answers_when_its_port_is_known(agent_port: int) -> None:
    source = node_metrics(agent_port)
    assert isinstance(source, RayAgentMetrics) and source.url.startswith("http://127.0.0.1:")
    assert await node_or_own(source, "own 1\n") == AGENT_TEXT


async def test_without_the_port_or_with_the_agent_down_it_is_the_replica_s_own() -> None:
    assert node_metrics(0) is None
    assert await node_or_own(None, "own 1\n") == "own 1\n"
    assert await node_or_own(Failing(), "own 1\n") == "own 1\n"
