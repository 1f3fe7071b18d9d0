"""The front door: one HTTP request's body into one typed ``PreparedRequest``.

Every OpenAI server (the direct path's router and replica, the proxy path's ingress, the
standalone replica server) prepares a request here, in one order, each step cheaper than the
work it saves: read the body within the limit (413), parse it (400), check the model (404),
the limits before tokenizing (``limits.admit``: 400), tokenize (400 for a token id out of the
vocabulary), the engine's sampling settings (400, ``context_length_exceeded`` among them),
the prompt's ``PrefixKey``, and the request's priority (400). Authentication comes before (the
tenant is known before the body is read, ``auth.request_tenant``); quotas after
(``quota.TenantQuotas``: a request the front door refuses is never charged).

The tokenizer and the hasher come in through the small protocols below, so a test gives fakes.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixmesh.api.errors import APIError
from prefixmesh.api.limits import BodySource, RequestLimits
from prefixmesh.api.priority import request_priority
from prefixmesh.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.wire import GenerateRequest, SamplingSettings
from prefixmesh.wire.route_ticket import RouteTicket

OpenAIRequest = CompletionRequest | ChatCompletionRequest
_CHAT_KEYS = (b'"messages"',)
"""A chat completion's body has ``messages`` (a quote inside a JSON string is escaped, so a
prompt cannot contain this byte string)."""


class PromptTokenizer(Protocol):
    """What the front door needs of a tokenizer (``prompts.PromptEncoder``)."""

    @property
    def eos_token_id(self) -> int | None: ...

    async def prompt_of(self, body: OpenAIRequest, chat: bool) -> tuple[list[int], int | None]: ...


class PromptHasher(Protocol):
    """What the front door needs of the block hasher (``cache_registry.hashing``)."""

    def hash_tokens(self, token_ids: Sequence[int]) -> PrefixKey: ...


def is_chat(raw: bytes) -> bool:
    """Whether a body is a chat completion's, for a caller that sees the body, not the path
    (the direct path's router: HAProxy forwards the body alone)."""
    return any(key in raw for key in _CHAT_KEYS)


def check_model(requested: str, served: str, server: str = "this cluster") -> None:
    """404 for a model the server does not serve (``server`` names it in the message)."""
    if requested != served:
        raise APIError(
            404,
            f"model {requested!r} does not exist; {server} serves {served!r}",
            param="model",
            code="model_not_found",
        )


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request the front door accepted: everything a server needs to route or serve it."""

    body: OpenAIRequest
    chat: bool
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSettings
    key: PrefixKey
    """The chained hashes of the prompt's full blocks, as the hasher made them."""
    tenant: str = "anonymous"
    priority: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        return self.body.stop_strings()

    def engine_request(
        self,
        request_id: str,
        *,
        ticket: RouteTicket | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> GenerateRequest:
        """What a replica's engine is asked (``wire.GenerateRequest``): this prompt, its key,
        sampling, tenant and priority, under ``request_id`` and the routing decision."""
        return GenerateRequest(
            request_id,
            self.prompt_token_ids,
            self.key,
            self.sampling,
            ticket=ticket,
            trace_context=trace_context,
            tenant=self.tenant,
            priority=self.priority,
        )


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """One server's preparation: its model, limits, tokenizer and hasher."""

    model: str
    limits: RequestLimits
    tokenizer: PromptTokenizer
    hasher: PromptHasher
    server: str = "this cluster"
    """How a 404's message names the server (the standalone server: ``this replica``)."""

    async def read(self, source: BodySource) -> bytes:
        """The body within ``limits.max_body_bytes`` (413 past it, before it is read)."""
        return await self.limits.read_body(source)

    def parse(self, raw: bytes, chat: bool) -> OpenAIRequest:
        """The validated body, of a served model, within the limits checked before
        tokenizing."""
        body: OpenAIRequest = (
            parse_body(raw, ChatCompletionRequest) if chat else parse_body(raw, CompletionRequest)
        )
        check_model(body.model, self.model, self.server)
        self.limits.admit(body)
        return body

    async def prepare(
        self,
        raw: bytes,
        chat: bool,
        *,
        tenant: str = "anonymous",
        headers: Mapping[str, str] | None = None,
    ) -> PreparedRequest:
        """``raw`` (a body ``read`` returned) prepared, or the ``APIError`` that refuses it.
        ``headers``: the request's, whose priority header counts; None for a server that does
        not schedule by priority (the direct path's router, the standalone server): 0."""
        body = self.parse(raw, chat)
        ids, max_tokens = await self.tokenizer.prompt_of(body, chat)
        sampling = body.engine_sampling(
            len(ids),
            max_tokens,
            self.limits.max_model_len,
            self.tokenizer.eos_token_id,
            self.limits.max_tokens,
        )
        key = self.hasher.hash_tokens(ids)
        priority = 0 if headers is None else request_priority(headers, body.priority)
        return PreparedRequest(body, chat, tuple(ids), sampling, key, tenant, priority)
