"""Responses, server-sent events and the response headers as every prefixmesh server renders
them (the proxy path's ingress, the direct path's replica, the standalone replica server), so
they answer alike; what comes in is prepared by ``prepare.py``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixmesh.api.errors import APIError
from prefixmesh.api.generation import Generation, TextDelta

REPLICA_HEADER = "x-prefixmesh-replica"
RETRIES_HEADER = "x-prefixmesh-retries"
MATCHED_BLOCKS_HEADER = "x-prefixmesh-matched-blocks"
ROUTED_BY_HEADER = "x-prefixmesh-routed-by"
"""On the direct path: the router's reason for sending the request here (its ticket), or
``unrouted`` for a request that reached the replica without a decision (HAProxy balancing on
its own, or its fallback to Ray's Python proxy)."""
UNROUTED = "unrouted"
REPLICA_FAILED = "replica_failed"
"""The ``code`` of the error event that ends a stream whose replica failed mid-stream."""


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model a server serves."""
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "prefixmesh",
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def brief(exc: BaseException) -> str:
    """An exception as one line: Ray wraps remote errors with whole tracebacks."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def mid_stream_error(exc: BaseException) -> APIError:
    return APIError(
        502,
        f"the replica failed mid-stream: {brief(exc)}",
        error_type="server_error",
        code=REPLICA_FAILED,
    )


def choice_delta(delta: TextDelta, chat: bool) -> dict[str, Any]:
    index, finish = delta.index, delta.finish_reason
    if chat:
        content = {"content": delta.text} if delta.text else {}
        return {"index": index, "delta": content, "finish_reason": finish}
    return {"index": index, "text": delta.text, "logprobs": None, "finish_reason": finish}


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice's whole text and why it ended."""

    text: str
    finish_reason: str = "stop"


def full_body(
    request_id: str,
    model: str,
    chat: bool,
    outputs: Sequence[ChoiceOutput],
    generation: Generation,
) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": request_id,
        "created": int(time.time()),
        "model": model,
        "usage": generation.usage.as_dict(),
    }
    if chat:
        chat_choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": output.text},
                "finish_reason": output.finish_reason,
            }
            for index, output in enumerate(outputs)
        ]
        return {**base, "object": "chat.completion", "choices": chat_choices}
    text_choices = [
        {
            "index": index,
            "text": output.text,
            "logprobs": None,
            "finish_reason": output.finish_reason,
        }
        for index, output in enumerate(outputs)
    ]
    return {**base, "object": "text_completion", "choices": text_choices}


async def collect(generation: Generation) -> list[ChoiceOutput]:
    """Every choice's whole output and finish reason, by index."""
    parts: list[list[str]] = [[] for _ in range(generation.choices)]
    finishes = ["stop"] * generation.choices
    async for delta in generation.deltas():
        parts[delta.index].append(delta.text)
        finishes[delta.index] = delta.finish_reason or finishes[delta.index]
    return [ChoiceOutput("".join(p), f) for p, f in zip(parts, finishes, strict=True)]


async def sse_events(
    generation: Generation,
    request_id: str,
    model: str,
    chat: bool,
    include_usage: bool,
    on_failed: Callable[[BaseException], APIError],
    on_done: Callable[[], None] = lambda: None,
) -> AsyncIterator[bytes]:
    """A started generation as OpenAI's server-sent events. A failure mid-stream ends it with
    ``on_failed``'s error event, then ``[DONE]`` (the client already has output)."""
    base = {
        "id": request_id,
        "created": int(time.time()),
        "model": model,
        "object": "chat.completion.chunk" if chat else "text_completion",
    }
    if chat:  # the role first, in one chunk per choice (as vLLM sends it)
        for index in range(generation.choices):
            role = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield sse({**base, "choices": [{"index": index, **role}]})
    try:
        async for delta in generation.deltas():
            yield sse({**base, "choices": [choice_delta(delta, chat)]})
    except Exception as exc:
        yield sse(on_failed(exc).body())
    else:
        if include_usage:
            yield sse({**base, "choices": [], "usage": generation.usage.as_dict()})
        on_done()
    yield sse("[DONE]")
