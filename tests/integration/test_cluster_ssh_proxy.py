"""cluster-local.yaml's SSH proxy command, run the way ssh runs it (``sh -c "exec ..."`` with %h
filled in, the port from $PREFIXMESH_SSH_PORT, ssh's data on its stdin and stdout, SIGHUP when
ssh exits) against a TCP listener of the test's: bytes pass both ways, and once ssh is gone the
connection closes and none of its processes is left. The first version kept the connection (and
the login session on the head) open after every ssh: ``make deploy-check`` found it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_AS_SSH_STARTS_IT = (
    "import os, signal, sys; "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP}); "
    "os.execv('/bin/sh', ['/bin/sh', '-c', sys.argv[1]])"
)
"""``sh -c COMMAND`` with SIGHUP at its default disposition, unblocked (exec keeps the pid)."""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    try:
        yield server
    finally:
        server.close()


def test_the_proxy_command_carries_ssh_and_ends_with_it(listener: socket.socket) -> None:
    cluster = yaml.safe_load((ROOT / "manifests/cluster/cluster-local.yaml").read_text())
    command = cluster["auth"]["ssh_proxy_command"].replace("%h", "127.0.0.1")
    port = listener.getsockname()[1]
    # ssh starts its proxy command with SIGHUP at its default; the test process may not have it
    # so after the suite's earlier tests (the command then outlived its SIGHUP in the full suite,
    # twice, and never alone), so the command starts from a default disposition and mask.
    proxy = subprocess.Popen(
        [sys.executable, "-c", _AS_SSH_STARTS_IT, f"exec {command}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": os.environ["PATH"], "PREFIXMESH_SSH_PORT": str(port)},
    )
    assert proxy.stdin is not None and proxy.stdout is not None
    connection, _ = listener.accept()
    spawned: list[psutil.Process] = []
    try:
        connection.settimeout(10)
        proxy.stdin.write(b"SSH-2.0-client\n")
        proxy.stdin.flush()
        assert connection.recv(64) == b"SSH-2.0-client\n"
        connection.sendall(b"SSH-2.0-server\n")
        assert proxy.stdout.readline() == b"SSH-2.0-server\n"

        spawned = [psutil.Process(proxy.pid), *psutil.Process(proxy.pid).children(recursive=True)]
        # ssh exits: its ends of the pipes close, and it sends the proxy command SIGHUP.
        proxy.stdin.close()
        os.kill(proxy.pid, signal.SIGHUP)
        proxy.stdout.close()
        assert connection.recv(64) == b""  # every holder of the connection let go of it
        _, alive = psutil.wait_procs(spawned, timeout=10)
        assert alive == []
    finally:
        connection.close()
        for process in spawned:  # ours, by PID, when an assertion above failed
            if process.is_running():
                process.kill()
        proxy.wait(timeout=10)
