"""Reading one streamed OpenAI response: time to first token, the gaps between tokens, usage.

Transport-free (a ``readline`` callable and a clock), so the locustfile's gevent client and the
tests share it. TTFT is the arrival of the first event that carries generated text (or ends the
choice); chat's opening role-only event does not count, as in vLLM's benchmark. Inter-token
latency is the gap between consecutive such events (one event per engine step or less).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamResult:
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    event_times_s: list[float] = field(default_factory=list)
    """Arrival of each content event, from the request's start."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    bytes_read: int = 0

    @property
    def itl_s(self) -> list[float]:
        t = self.event_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None


def _content(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def read_stream(
    readline: Callable[[], bytes], started_s: float, clock: Callable[[], float]
) -> StreamResult:
    """Consume a text/event-stream body line by line (``readline`` returns b"" at the end)."""
    result = StreamResult(status=200)
    while True:
        line = readline()
        if not line:
            break
        result.bytes_read += len(line)
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        now = clock() - started_s
        try:
            event = json.loads(data)
        except ValueError:
            result.error = f"bad event: {data[:100]!r}"
            break
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))[:300]
            break
        usage = event.get("usage")
        if usage:
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in event.get("choices") or ():
            finish = choice.get("finish_reason")
            if _content(choice) or finish:
                result.event_times_s.append(now)
                if result.ttft_s is None:
                    result.ttft_s = now
            if finish:
                result.finish_reason = finish
    result.e2e_s = clock() - started_s
    if result.ttft_s is None and not result.error:
        result.error = "the stream ended without a token"
    return result
