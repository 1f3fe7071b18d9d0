"""``free_port`` picks listener ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from prefixmesh import ports
from prefixmesh.ports import LISTENER_PORTS, free_port


def test_free_ports_stay_out_of_the_kernels_ephemeral_range() -> None:
    """Regression: a port the kernel picked (bind to port 0) for HAProxy's stats listener was
    taken by an outgoing connection or another port-0 bind before HAProxy started, minutes
    later under two busy loops: the two-node test's setup failed with EADDRINUSE."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        first, last = (int(n) for n in ranges.read().split())
    for _ in range(50):
        port = free_port()
        assert port in LISTENER_PORTS and not first <= port <= last


def test_a_port_in_use_on_any_address_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    held = free_port()
    other = held + 1 if held + 1 in LISTENER_PORTS else held - 1
    picks: Iterator[int] = iter([held, held, other])
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: LISTENER_PORTS.index(next(picks)))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.2", held))  # another loopback address, as a Ray node's
        listener.listen()
        assert free_port() == other
