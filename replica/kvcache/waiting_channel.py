"""Requests waiting outside the engine, told to the KV connector's lookahead (issue 18, item 5).

A replica holds some requests back before they reach vLLM: delay-hit holds (waiting for a
prefix another request computes) and the fair-share gate. The lookahead of the connector's
cache policy hears of vLLM's own waiting queue through ``on_new_request``, but the connector
runs in vLLM's engine-core process, which knows nothing of the replica's waits. This channel
carries them there: the replica process sends one datagram when a request starts waiting
outside (``Waiting``: its prompt's block hashes, the same chain the connector computes) and one
when it stops (``Left``: it goes to the engine now, or gave up); the connector drains the socket
on its scheduler thread at each step and tells its ``Lookahead`` (ids prefixed ``outside:``,
so they never meet vLLM's).

A Unix datagram socket: no thread, no connection to keep, message boundaries kept, order kept.
Sending never blocks and never fails a request: a full buffer or a connector not listening yet
drops the notice (the lookahead is a hint; it bounds what it tracks anyway).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixmesh.cache_registry.types import BlockHash
from prefixmesh.replica.kvcache.policy.lookahead import RequestQueue

OUTSIDE_PREFIX = "outside:"
"""How the connector names a request waiting outside the engine in its lookahead."""
MAX_BLOCKS = 4096
"""Blocks a notice carries at most (the head of a longer prompt): ~80 kB, under the kernel's
default datagram limit."""
_RECEIVE_BYTES = 1 << 18
OUTSIDE_TTL_S = 900.0


@dataclass(frozen=True, slots=True)
class Waiting:
    """``request_id`` waits outside the engine; its prompt's blocks (chained hashes)."""

    request_id: str
    blocks: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Left:
    """``request_id`` no longer waits outside (it was submitted to the engine, or left)."""

    request_id: str


Notice = Waiting | Left


def encode(notice: Notice) -> bytes:
    if isinstance(notice, Waiting):
        data: dict[str, object] = {"w": notice.request_id, "b": notice.blocks[:MAX_BLOCKS]}
    else:
        data = {"l": notice.request_id}
    return json.dumps(data, separators=(",", ":")).encode()


def decode(datagram: bytes) -> Notice | None:
    """The notice in ``datagram``; None for anything else (never raises)."""
    try:
        data = json.loads(datagram)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(left := data.get("l"), str):
        return Left(left)
    waiting, blocks = data.get("w"), data.get("b")
    if not isinstance(waiting, str) or not isinstance(blocks, list):
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        return None
    return Waiting(waiting, tuple(BlockHash(b) for b in blocks[:MAX_BLOCKS]))


class OutsideWaits:
    """Passes notices to a lookahead's ``queue`` (ids prefixed ``OUTSIDE_PREFIX``), and ends a
    wait whose ``Left`` never came (a datagram lost) after ``ttl_s``: no request outlives the
    request timeout (``ingress.request_timeout_s``, 600 s by default), and a stale entry would
    hold one of the lookahead's bounded slots for good."""

    def __init__(self, queue: RequestQueue, ttl_s: float = OUTSIDE_TTL_S) -> None:
        self.queue = queue
        self.ttl_s = ttl_s
        self.waits = 0
        """Requests heard to start waiting."""
        self._since: dict[str, float] = {}

    def hear(self, notices: Sequence[Notice], now: float) -> None:
        for notice in notices:
            key = OUTSIDE_PREFIX + notice.request_id
            if isinstance(notice, Waiting):
                self.waits += 1
                self._since[key] = now
                self.queue.queued(key, notice.blocks)
            else:
                self._since.pop(key, None)
                self.queue.started(key)
        while self._since:
            key, since = next(iter(self._since.items()))  # oldest first (insertion order)
            if now - since <= self.ttl_s:
                break
            del self._since[key]
            self.queue.started(key)

    @property
    def waiting(self) -> int:
        return len(self._since)


class NoticeSender:
    """The replica's end: fire-and-forget datagrams to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sent = 0
        self.dropped = 0
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def waiting(self, request_id: str, blocks: Sequence[BlockHash]) -> None:
        self._send(Waiting(request_id, tuple(blocks)))

    def left(self, request_id: str) -> None:
        self._send(Left(request_id))

    def _send(self, notice: Notice) -> None:
        try:
            self._socket.sendto(encode(notice), self.path)
        except OSError:  # not listening yet, gone, or its buffer is full: a hint lost
            self.dropped += 1
        else:
            self.sent += 1

    def close(self) -> None:
        self._socket.close()


class NoticeReceiver:
    """The connector's end: bound at ``path`` (a stale socket file replaced), drained without
    blocking."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.malformed = 0
        target = Path(path)
        if target.is_socket():
            target.unlink()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._socket.bind(path)

    def drain(self, limit: int = 1024) -> list[Notice]:
        """The notices received since the last call (at most ``limit``), oldest first."""
        notices: list[Notice] = []
        while len(notices) < limit:
            try:
                datagram = self._socket.recv(_RECEIVE_BYTES)
            except OSError:  # nothing more (BlockingIOError), or the socket is gone
                break
            notice = decode(datagram)
            if notice is None:
                self.malformed += 1
            else:
                notices.append(notice)
        return notices

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
