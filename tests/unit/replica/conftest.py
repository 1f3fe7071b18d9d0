"""A replica server with the sim engine: in-process (TestClient) or on a free loopback port."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.ports import free_port

SIM = ("replica.engine=sim", "replica.sim.kv_blocks=64", "replica.vllm.max_model_len=4096")


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``check`` to hold (the bound is only against a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def sim_config(*overrides: str) -> PrefixmeshConfig:
    return load_config(overrides=[*SIM, *overrides])


@dataclass
class LiveServer:
    url: str
    service: object


@pytest.fixture
def live_replica_server() -> Iterator[Callable[..., LiveServer]]:
    """Start replica servers (sim) with uvicorn on threads; stopped after the test."""
    import uvicorn

    from prefixmesh.replica.serving.standalone_server import build_app, make_service

    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*overrides: str) -> LiveServer:
        service = make_service(sim_config(*overrides), f"r{len(started)}")
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the replica server did not start")
            time.sleep(0.02)
        started.append((server, thread))
        return LiveServer(f"http://127.0.0.1:{port}", service)

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=15)
