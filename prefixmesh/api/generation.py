"""One request's trip through a replica, as the ingress sees it.

Wraps the replica's token stream: tells the router's ledger about the first token and the end,
detokenizes incrementally, applies stop strings (and then closes the stream, which aborts the
request in the engine and frees its KV), and keeps the usage numbers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prefixmesh.api.detokenize import Decode, IncrementalDetokenizer
from prefixmesh.wire import GenerateChunk, GenerateRequest, RouteTicket


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        stream: Any,
        decode: Decode,
        prompt_tokens: int,
        stop_strings: list[str],
        on_first_token: Callable[[], None],
        on_end: Callable[[], None],
        request: GenerateRequest | None = None,
        started_s: float | None = None,
        routed: Callable[[], RouteTicket | None] | None = None,
    ) -> None:
        """``routed``: how to learn the routing decision of a request sent without one (the
        proxy path's ingress takes it from the state it shares with the request router),
        called once, when the first output or the failure before it arrives."""
        self._stream = stream
        self.ticket: RouteTicket | None = request.ticket if request is not None else None
        """The routing decision: the request's own, or what ``routed`` returned."""
        self._routed = routed
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stop = stop_strings
        self._on_first_token = on_first_token
        self._on_end = on_end
        self.usage = Usage(prompt_tokens)
        self.replica_id = ""
        self.first_token_s: float | None = None
        self.held_s = 0.0
        self._started = time.monotonic() if started_s is None else started_s
        """When the client's request started (a retry keeps the first attempt's start)."""
        self._pending: GenerateChunk | None = None
        self._ended = False

    async def first(self) -> None:
        """Wait for the first chunk (so a failure before any output is a plain HTTP error)."""
        try:
            self._pending = await self._stream.__anext__()
        except StopAsyncIteration:
            self._pending = None
        except BaseException:
            self._learn_ticket()  # the replica the router chose is the one to avoid
            self.close()
            raise
        self._learn_ticket()
        self._note_first(self._pending)

    def _learn_ticket(self) -> None:
        if self._routed is not None:
            self.ticket = self._routed() or self.ticket
            self._routed = None

    def _note_first(self, chunk: GenerateChunk | None) -> None:
        self.first_token_s = time.monotonic() - self._started
        self._on_first_token()
        if chunk is not None:
            self.replica_id = chunk.replica_id
            self.usage.cached_tokens = chunk.num_cached_tokens
            self.held_s = chunk.held_s

    @property
    def routed_to(self) -> str:
        """The replica serving this: the one that answered, else the one the router chose."""
        if self.replica_id:
            return self.replica_id
        return self.ticket.replica_id if self.ticket is not None else ""

    async def deltas(self) -> AsyncIterator[TextDelta]:
        try:
            chunk = self._pending
            while chunk is not None:
                self.usage.completion_tokens += len(chunk.token_ids)
                text = self._detokenizer.add(chunk.token_ids)
                if chunk.finished:
                    text += self._detokenizer.flush()
                stop_at = self._find_stop()
                if stop_at is not None:
                    keep = len(text) - (len(self._detokenizer.text) - stop_at)
                    yield TextDelta(text[: max(keep, 0)], "stop")
                    return
                if chunk.finished:
                    yield TextDelta(text, chunk.finish_reason or "stop")
                    return
                if text:
                    yield TextDelta(text)
                try:
                    chunk = await self._stream.__anext__()
                except StopAsyncIteration:
                    chunk = None
            yield TextDelta("", "stop")
        finally:
            self.close()

    def _find_stop(self) -> int | None:
        text = self._detokenizer.text
        positions = [p for s in self._stop if s and (p := text.find(s)) >= 0]
        return min(positions) if positions else None

    def close(self) -> None:
        """End the request: cancel the replica stream if it is still running (aborting it in
        the engine) and tell the ledger. Idempotent."""
        if self._ended:
            return
        self._ended = True
        try:
            self._stream.cancel()
        finally:
            self._on_end()
