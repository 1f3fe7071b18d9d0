"""``prefixmesh serve`` as a user starts it, in a session of its own: what it listens on, and
what it leaves after a SIGTERM and after a SIGKILL (issue 38).

The one listener outside loopback allowed is the one Ray 2.60 hard-codes and we cannot move:
the inter-deployment gRPC server of every Serve replica (``[::]:0``,
``ray/serve/_private/replica.py``; docs/design.md §7). HAProxy's stats page and Prometheus
exporter, which Ray's template binds on every interface, are rebound to loopback
(``local_ray.haproxy_wrapper``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from prefixmesh.ports import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "demo-tiny"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
READY_TIMEOUT_S = 240.0


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    temp_dir: Path
    metrics_url: str = ""
    """Where ``serve`` said the cluster's metrics are."""

    def session(self) -> list[psutil.Process]:
        """Every process of the run's session (``serve`` is its leader), HAProxy included."""
        found = []
        for process in psutil.process_iter(["pid"]):
            # A process may end between the listing and getsid (ProcessLookupError).
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(process.pid) == self.process.pid:
                    found.append(process)
        return found


def start(tmp: Path) -> Served:
    port = free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="pms-", dir="/tmp"))  # Ray's socket paths: short
    command = [
        sys.executable,
        "-c",
        "import sys; from prefixmesh.cli import main; sys.exit(main(sys.argv[1:]))",
        "serve",
        "--set",
        "replica.engine=sim",
        "--set",
        "replica.num_replicas=1",
        "--set",
        f"ingress.port={port}",
        "--set",
        f"ray.temp_dir={temp_dir}",
    ]
    log = (tmp / "serve.log").open("w")
    # As from a fresh shell: without the Ray and HAProxy settings this test process has
    # (tests/conftest.py configures HAProxy for the session's own cluster).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, env=env
    )
    served = Served(process, port, temp_dir)
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()  # read in a thread: a wait here has a deadline
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    ready = False
    while not ready and process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            # "prefixmesh is serving ... (Ctrl-C stops it)" once it is ready
            ready = "is serving" in lines.get(timeout=1.0)
    assert ready, (tmp / "serve.log").read_text()[-3000:]
    with contextlib.suppress(queue.Empty):  # "metrics of every replica ...: URL (...)"
        words = lines.get(timeout=10.0).split()
        served.metrics_url = next((w for w in words if w.startswith("http://")), "")
    return served


def wait_ended(served: Served, within_s: float) -> list[str]:
    """The processes of the run still there after ``within_s`` (zombies do not count)."""
    deadline = time.monotonic() + within_s
    left: list[str] = []
    while time.monotonic() < deadline:
        left = []
        for process in served.session():
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(process.cmdline())[:80])
        if not left:
            break
        time.sleep(0.5)
    return left


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    run = start(tmp_path)
    try:
        yield run
    finally:
        for process in run.session():  # whatever a failed test left: ours, by session
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(run.temp_dir, ignore_errors=True)


def test_serve_answers_listens_on_loopback_and_stops_clean(served: Served) -> None:
    response = httpx.post(
        f"http://127.0.0.1:{served.port}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert served.metrics_url.startswith("http://127.0.0.1:")
    assert httpx.get(served.metrics_url, timeout=30).status_code == 200  # Ray's metrics agent
    # The front door's /metrics is the node's view (the agent's, ray_*), whichever replica
    # HAProxy picks: never one replica's own registry.
    for _ in range(3):
        scrape = httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=30)
        assert scrape.status_code == 200 and "ray_" in scrape.text
    outside: list[str] = []
    for process in served.session():
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(process.cmdline())
            for conn in process.net_connections(kind="inet"):
                if conn.status != psutil.CONN_LISTEN or conn.laddr.ip in LOOPBACK:
                    continue
                if "ServeReplica" in cmdline and conn.laddr.ip == "::":
                    continue  # Serve's inter-deployment gRPC server: Ray binds [::]:0
                outside.append(f"{cmdline[:60]} on {conn.laddr.ip}:{conn.laddr.port}")
    assert outside == []
    # HAProxy's own listeners besides the front door: its stats page answers at /stats.
    admin_ports = {
        conn.laddr.port
        for process in served.session()
        if "haproxy" in " ".join(_cmdline(process))
        for conn in _listening(process)
        if conn.laddr.port != served.port
    }
    pages = [httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10) for port in admin_ports]
    assert any(page.status_code == 200 and "Statistics" in page.text for page in pages)
    haproxy_dirs = {
        part.split("/")[2]
        for process in served.session()
        for part in _cmdline(process)
        if part.startswith("/tmp/pmh-")
    }
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0
    assert wait_ended(served, within_s=20) == []
    assert port_is_free(served.port)
    assert haproxy_dirs and not any((Path("/tmp") / d).exists() for d in haproxy_dirs)


def test_a_killed_serve_leaves_nothing_running_nor_the_port_held(served: Served) -> None:
    served.process.send_signal(signal.SIGKILL)  # as a crash or the OOM killer would
    served.process.wait(timeout=10)
    assert wait_ended(served, within_s=60) == []
    assert port_is_free(served.port)


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


def _listening(process: psutil.Process) -> list[Any]:
    with contextlib.suppress(psutil.Error):
        return [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    return []
