"""One request's trip through a replica, as the ingress sees it.

Wraps the replica's token stream: tells the router's ledger about the first token and the end,
detokenizes incrementally, applies stop strings (and then closes the stream, which aborts the
request in the engine and frees its KV), and keeps the usage numbers. A request for ``n``
choices streams its choices' chunks interleaved (``GenerateChunk.index``); each choice has its
own detokenizer and stop, and the stream closes once every choice has ended.
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
    index: int = 0
    """The choice this text belongs to (0 unless the request asked for ``n`` > 1)."""


class _Choice:
    """One choice's text so far and whether it has ended. Text that could begin a stop string
    is held back until the next tokens tell (as vLLM does), so a stop string split over two
    chunks never reaches the client."""

    def __init__(self, decode: Decode, stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop = [s for s in stop if s]
        self.ended = False
        self._sent = 0
        """Characters of the text already handed out."""

    def add(self, chunk: GenerateChunk) -> TextDelta | None:
        """The text ``chunk`` adds (cut at a stop string, which ends the choice), or None."""
        self.detokenizer.add(chunk.token_ids)
        if chunk.finished:
            self.detokenizer.flush()
        text = self.detokenizer.text
        stop_at = self._find_stop(text)
        if stop_at is not None:
            self.ended = True
            return TextDelta(text[self._sent : max(stop_at, self._sent)], "stop", chunk.index)
        if chunk.finished:
            self.ended = True
            return TextDelta(text[self._sent :], chunk.finish_reason or "stop", chunk.index)
        ready = len(text) - self._held_back(text)
        if ready <= self._sent:
            return None
        delta = TextDelta(text[self._sent : ready], None, chunk.index)
        self._sent = ready
        return delta

    def rest(self, index: int) -> TextDelta:
        """The end of a choice whose stream stopped without finishing: the text held back
        (and the detokenizer's last partial character), as a stop."""
        self.detokenizer.flush()
        self.ended = True
        return TextDelta(self.detokenizer.text[self._sent :], "stop", index)

    def _find_stop(self, text: str) -> int | None:
        # Only the part not yet searched can hold a new match (a stop string's length back).
        start = max(0, self._sent - max((len(s) for s in self.stop), default=0))
        positions = [p for s in self.stop if (p := text.find(s, start)) >= 0]
        return min(positions) if positions else None

    def _held_back(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string: only the
        places in the last ``len(stop) - 1`` characters where the stop's first one occurs are
        tried, earliest (longest) first."""
        longest = 0
        for stop in self.stop:
            at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while at != -1 and len(text) - at > longest:
                if stop.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(stop[0], at + 1)
        return longest


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
        choices: int = 1,
    ) -> None:
        """``routed``: how to learn the routing decision of a request sent without one (the
        proxy path's ingress takes it from the state it shares with the request router),
        called once, when the first output or the failure before it arrives. ``choices``: the
        request's ``n``."""
        self._stream = stream
        self.ticket: RouteTicket | None = request.ticket if request is not None else None
        """The routing decision: the request's own, or what ``routed`` returned."""
        self._routed = routed
        self._choices = [_Choice(decode, stop_strings) for _ in range(max(1, choices))]
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

    @property
    def choices(self) -> int:
        return len(self._choices)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Each choice's text as it comes, and one delta with its finish reason at its end."""
        try:
            chunk = self._pending
            while chunk is not None:
                choice = self._choices[chunk.index]
                # A choice past its stop string may run on until the others end (its engine
                # request is aborted with the stream): its tokens after the stop are not billed.
                if not choice.ended:
                    self.usage.completion_tokens += len(chunk.token_ids)
                delta = None if choice.ended else choice.add(chunk)
                if delta is not None:
                    yield delta
                if all(c.ended for c in self._choices):
                    return
                try:
                    chunk = await self._stream.__anext__()
                except StopAsyncIteration:
                    chunk = None
            for index, choice in enumerate(self._choices):
                if not choice.ended:  # the stream ended without a finish: what it held back
                    yield choice.rest(index)
        finally:
            self.close()

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
