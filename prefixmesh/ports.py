"""Listener ports picked on this machine (the dev cluster, the vLLM engine's event socket,
benchmarks and tests): ``free_port``, outside the kernel's ephemeral range."""

from __future__ import annotations

import secrets
import socket

LISTENER_PORTS = range(20_000, 32_768)
"""Where ``free_port`` picks: below Linux's default ephemeral range (32768-60999), which the
kernel hands to outgoing connections and port-0 binds, and above Ray's default worker ports
(10002-19999). A port picked in the ephemeral range can be taken by one of those before its
listener binds it (Ray starts HAProxy minutes after its ports are picked on a loaded machine:
its stats port was taken so once, under two busy loops)."""


def free_port() -> int:
    """A port no socket on this machine uses now, for a listener started later."""
    for _ in range(1000):
        port = LISTENER_PORTS[secrets.randbelow(len(LISTENER_PORTS))]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                # The wildcard address conflicts with a socket on any address (the two-node
                # test's head is 127.0.0.2); bound without listening, it accepts nothing.
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTENER_PORTS}")
