"""``limits``: what one request may ask for."""

from __future__ import annotations

from pydantic import Field

from prefixmesh.config.base import Section


class LimitsConfig(Section):
    """What one request may ask for, checked before any work is spent on it: the direct path's
    router and replicas, the proxy path's ingress and the standalone replica server refuse past
    these with OpenAI's errors. A request's total time is bounded by
    ``ingress.request_timeout_s`` (streams included, on every path)."""

    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body in bytes: a longer one is refused with 413 before it is read (by
    its Content-Length, else counted as it arrives). None: ``serving.max_body_bytes``, what
    HAProxy buffers for the router (a longer body would be routed blind)."""
    max_chars_per_token: float | None = Field(default=None, gt=0)
    """Most characters one token covers: a text prompt of C characters has at least C / this
    many tokens, so one that cannot fit the context is refused (400
    ``context_length_exceeded``) before it is tokenized. None: the longest token of the
    model's fast tokenizer, which holds for every text (no text precheck when its normalizer
    may drop characters, or it is not a fast tokenizer). A smaller value refuses earlier but
    may refuse a prompt that fits (long runs of whitespace are single tokens in most
    vocabularies)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Most tokens one request may generate: a larger ``max_tokens`` (or
    ``max_completion_tokens``) is refused with 400, and a request that names none gets at most
    this many. None: the context length is the only bound."""
