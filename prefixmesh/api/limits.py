"""Limits before work: what a request may ask for, checked before its body is read whole, parsed
or tokenized (issue 17).

Every OpenAI server (the direct path's router and replicas, the proxy path's ingress, the
standalone replica server) holds one ``RequestLimits`` made from the config and its tokenizer,
and refuses in this order, each step cheaper than the work it saves:

1. a body longer than ``max_body_bytes``: 413, by its Content-Length before a byte is read, or
   counted as it arrives (``read_body``);
2. after parsing: a ``max_tokens`` over the cap (400), and a prompt that cannot fit the context
   whatever its tokens (400 ``context_length_exceeded``), from its length in characters (or
   token ids) and the most characters one token covers (``admit``);
3. a request that runs past ``timeout_s`` from its arrival: 504, or an error event that ends
   its stream (``until_deadline``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prefixmesh.api.errors import APIError, context_length_exceeded
from prefixmesh.api.protocol import loads
from prefixmesh.api.render import sse
from prefixmesh.config import PrefixmeshConfig

REQUEST_TOO_LARGE = "request_too_large"
"""The ``code`` of a 413: the body is longer than ``limits.max_body_bytes``."""
TIMED_OUT = "timeout"
"""The ``code`` of a request that ran past ``ingress.request_timeout_s``."""
_KEEPS_LENGTH = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})
"""Normalizers that never make a text shorter (decompositions, case folding to lower, a prefix):
a prompt's characters still bound its tokens from below through the longest token."""


class BodySource(Protocol):
    """What ``read_body`` needs of a request (Starlette's ``Request``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


class Prompted(Protocol):
    """A parsed OpenAI request, as ``admit`` reads it (``protocol.py``)."""

    @property
    def prompt_param(self) -> str: ...

    def prompt_extent(self) -> tuple[int, bool]: ...

    def requested_max_tokens(self) -> tuple[int | None, str]: ...


def body_too_large(limit: int, size: int | None = None) -> APIError:
    has = f"has {size} bytes" if size is not None else f"is longer than {limit} bytes"
    return APIError(
        413, f"the request body {has}; the limit is {limit} bytes", code=REQUEST_TOO_LARGE
    )


def timed_out(timeout_s: float) -> APIError:
    return APIError(
        504,
        f"the request timed out after {timeout_s:g} s",
        error_type="server_error",
        code=TIMED_OUT,
    )


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The body length a request's Content-Length declares (None: none, or not a number)."""
    value = headers.get("content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def read_body(request: BodySource, limit: int) -> bytes:
    """The whole body, or a 413 ``APIError`` without reading it when its Content-Length is over
    ``limit``, or as soon as the bytes received pass it (a chunked body, or a lying header)."""
    declared = declared_length(request.headers)
    if declared is not None and declared > limit:
        raise body_too_large(limit, declared)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


async def read_json(request: BodySource, limit: int) -> Any:
    """A JSON body read within ``limit`` (400 when it is not JSON)."""
    return loads(await read_body(request, limit))


def _normalizer_keeps_length(normalizer: Mapping[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":  # a literal string by one at least as long (SentencePiece's spaces)
        pattern = normalizer.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, Mapping) else None
        content = normalizer.get("content", "")
        return isinstance(literal, str) and len(str(content)) >= len(literal) > 0
    return kind in _KEEPS_LENGTH


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of a fast tokenizer can stand for: the longest token
    string of its vocabulary and added tokens (byte-level vocabularies spell a token one
    character per byte, byte-fallback tokens ``<0x41>`` are longer than their byte: both only
    overstate it). None when that bounds nothing: not a fast tokenizer, or a normalizer that
    may shorten the text before it is split (compositions, stripping, deletions)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except (ValueError, AttributeError):
        return None
    if not _normalizer_keeps_length(normalizer):
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t is not None), default=None)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int
    max_model_len: int
    max_chars_per_token: float | None
    """None: no precheck of text prompts (their tokens are counted after tokenizing)."""
    max_tokens: int | None
    timeout_s: float

    @classmethod
    def from_config(cls, config: PrefixmeshConfig, tokenizer: Any = None) -> RequestLimits:
        """The config's limits; ``limits.max_chars_per_token`` unset is measured on
        ``tokenizer`` (``longest_token_chars``)."""
        limits = config.limits
        chars = limits.max_chars_per_token
        if chars is None and tokenizer is not None:
            chars = longest_token_chars(tokenizer)
        return cls(
            max_body_bytes=limits.max_body_bytes or config.serving.max_body_bytes,
            max_model_len=config.replica.vllm.max_model_len,
            max_chars_per_token=chars,
            max_tokens=limits.max_tokens,
            timeout_s=config.ingress.request_timeout_s,
        )

    async def read_body(self, request: BodySource) -> bytes:
        """The request's body within ``max_body_bytes`` (``read_body``)."""
        return await read_body(request, self.max_body_bytes)

    def least_prompt_tokens(self, body: Prompted) -> int | None:
        """The fewest tokens the prompt can tokenize to, without tokenizing it (None: not
        known). A chat template only adds tokens to the messages' text."""
        size, token_ids = body.prompt_extent()
        if token_ids:
            return size
        if self.max_chars_per_token is None:
            return None
        return math.ceil(size / self.max_chars_per_token)

    def admit(self, body: Prompted) -> None:
        """A 400 for a parsed request over a limit, before its prompt is tokenized: a
        ``max_tokens`` over the cap, or a prompt that cannot fit the context with it."""
        max_tokens, param = body.requested_max_tokens()
        if self.max_tokens is not None and max_tokens is not None and max_tokens > self.max_tokens:
            raise APIError(
                400,
                f"{param} is too large: {max_tokens}. This model supports at most "
                f"{self.max_tokens} completion tokens, whereas you provided {max_tokens}.",
                param=param,
            )
        least = self.least_prompt_tokens(body)
        # The engine needs room for one token at least (``engine_sampling``).
        if least is not None and least + (max_tokens or 1) > self.max_model_len:
            # The completion's fault when the prompt alone would fit (as engine_sampling).
            blamed = param if least < self.max_model_len else body.prompt_param
            raise context_length_exceeded(
                self.max_model_len, least, max_tokens, blamed, at_least=True
            )

    def deadline(self, elapsed_s: float = 0.0) -> float:
        """The event loop's time at which a request that arrived ``elapsed_s`` ago is out of
        time."""
        return asyncio.get_running_loop().time() + self.timeout_s - max(0.0, elapsed_s)


async def until_deadline(
    events: AsyncIterator[bytes], deadline: float, expired: Callable[[], APIError]
) -> AsyncGenerator[bytes, None]:
    """``events`` (server-sent events) until the event loop's clock reaches ``deadline``; then
    ``expired()``'s error event and ``[DONE]`` instead of the rest. Waiting on ``events`` is
    cancelled at the deadline, which closes the generation (it aborts the request)."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield sse(expired().body())
                yield sse("[DONE]")
                return
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
