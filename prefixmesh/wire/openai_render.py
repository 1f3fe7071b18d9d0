"""The OpenAI API's side of every server: prompts to token ids, and responses, server-sent
events and errors as OpenAI renders them.

One module for the router (which tokenizes to decide), the proxy path's ingress, the direct
path's replica and the standalone replica server, so they accept and answer alike.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from prefixmesh.wire.generation import Generation, TextDelta
from prefixmesh.wire.openai_protocol import APIError, ChatCompletionRequest

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


class PromptEncoder:
    """A Hugging Face tokenizer as the API uses it: text or token-id prompts, chat templates,
    decoding; long work off the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._vocab_size = len(tokenizer)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < self._vocab_size for t in prompt):
                raise APIError(422, "prompt token ids out of the vocabulary", param="prompt")
            return list(prompt)
        # Tokenizing a long prompt takes milliseconds of CPU: off the event loop.
        return list(await asyncio.to_thread(lambda: self.hf(prompt)["input_ids"]))

    async def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        return await self.encode_messages(
            [{"role": m.role, "content": m.text()} for m in body.messages]
        )

    async def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages through the model's chat template, with the generation prompt."""

        def render() -> list[int]:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding (a UserDict)
                ids = ids["input_ids"]
            return [int(t) for t in ids]

        return await asyncio.to_thread(render)

    async def prompt_of(self, body: Any, chat: bool) -> tuple[list[int], int | None]:
        """A validated request's prompt token ids and its ``max_tokens``."""
        if chat:
            return await self.encode_chat(body), body.max_completion_tokens or body.max_tokens
        return await self.encode(body.prompt), body.max_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"model {requested!r} does not exist; this cluster serves {served!r}",
            param="model",
            code="model_not_found",
        )


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "prefixmesh",
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}


def new_request_id(chat: bool) -> str:
    import uuid

    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


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
    if chat:
        content = {"content": delta.text} if delta.text else {}
        return {"index": 0, "delta": content, "finish_reason": delta.finish_reason}
    return {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}


def full_body(
    request_id: str, model: str, chat: bool, text: str, finish: str, generation: Generation
) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": request_id,
        "created": int(time.time()),
        "model": model,
        "usage": generation.usage.as_dict(),
    }
    if chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**base, "object": "text_completion", "choices": [choice]}


async def collect(generation: Generation) -> tuple[str, str]:
    """The whole output and its finish reason."""
    parts: list[str] = []
    finish = "stop"
    async for delta in generation.deltas():
        parts.append(delta.text)
        finish = delta.finish_reason or finish
    return "".join(parts), finish


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
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield sse({**base, "choices": [role]})
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
