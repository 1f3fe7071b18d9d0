"""The direct path's replica: the OpenAI API served by the replica itself, behind HAProxy.

HAProxy forwards each POST here after our router picked this replica, with the decision as
trusted headers (``RouteTicket``). The replica prepares the request through the front door the
router used (``api/prepare.py``: parse, tokenize, sample, hash; only headers cross from the
router, and the replica needs the ids, sampling and key itself), checks that its key matches
the router's digest (one xxh64 of the block hashes), waits out a hold, runs the engine and streams
server-sent events straight back. Nothing is sent before the first token: a replica that dies
before it leaves HAProxy an empty response, and one whose engine fails before it answers 503;
HAProxy sends both to another replica (``serving.retry_on`` with ``option redispatch``). After
the first token a failure ends the stream with an error event and ``[DONE]``.

Limits come before work (``api/limits.py``): a body over ``limits.max_body_bytes`` is refused
by its Content-Length before it is read (HAProxy routed it blind: the router saw a truncated
body), a prompt that cannot fit the context before it is tokenized, and a request that outlives
``ingress.request_timeout_s`` from its arrival at the router ends with a 504 or, streaming, an
error event. Every error is OpenAI JSON (``api/errors.py``), 404 and 405 included.

GETs (models, health, metrics) reach any replica: HAProxy balances them by connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from prefixmesh.api.auth import ApiKeys, refusal, request_tenant
from prefixmesh.api.errors import APIError, error_response, install_error_handlers
from prefixmesh.api.generation import Generation
from prefixmesh.api.limits import RequestLimits, timed_out, until_deadline
from prefixmesh.api.prepare import FrontDoor, PreparedRequest, new_request_id
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.api.quota import TenantQuotas, charge, settle_soon
from prefixmesh.api.render import (
    MATCHED_BLOCKS_HEADER,
    REPLICA_FAILED,
    REPLICA_HEADER,
    RETRIES_HEADER,
    ROUTED_BY_HEADER,
    UNROUTED,
    brief,
    collect,
    full_body,
    mid_stream_error,
    model_list,
    sse_events,
)
from prefixmesh.api.request_metrics import DirectMetrics
from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.replica.serving.deployment import ReplicaServer
from prefixmesh.replica.serving.spans import trace_parent
from prefixmesh.wire import GenerateChunk, GenerateRequest
from prefixmesh.wire.route_ticket import RouteTicket, key_digest

logger = logging.getLogger(__name__)
api = install_error_handlers(
    FastAPI(title="prefixmesh replica", docs_url=None, redoc_url=None, redirect_slashes=False)
)


class _LocalStream:
    """The replica's own chunk generator in the shape ``Generation`` reads."""

    def __init__(self, chunks: AsyncIterator[GenerateChunk]) -> None:
        self._chunks = chunks
        self._closing: asyncio.Task[None] | None = None

    async def __anext__(self) -> GenerateChunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        # Closing the generator runs its cleanup, which aborts the request in the engine.
        close = getattr(self._chunks, "aclose", None)
        if close is not None and self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(close())


def _noop() -> None:
    return None


@serve.ingress(api)
class ReplicaHTTPServer(ReplicaServer):
    # A server built without __init__ (unit tests) has no keys and no quotas.
    _keys: ApiKeys | None = None
    _quotas: TenantQuotas | None = None

    # Serve awaits an async constructor (mypy wants ``__init__`` to return None).
    async def __init__(self, config_json: str, model_path: str, router_name: str) -> None:  # type: ignore[misc]
        from transformers import AutoTokenizer

        await super().__init__(config_json, model_path, router_name)
        encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_path))
        limits = RequestLimits.from_config(self.config, encoder.hf)
        self._front = FrontDoor(self.config.model, limits, encoder, make_hasher(self.config))
        self._decode = encoder.decode
        self._metrics = DirectMetrics()
        self._keys = ApiKeys.from_config(self.config)
        self._quotas = TenantQuotas.from_config(self.config, self._metrics)
        self._created = int(time.time())

    async def shutdown(self) -> None:
        await super().shutdown()
        if self._quotas is not None:
            await self._quotas.close()

    # ---- small endpoints -------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        """What ``GET /health`` through HAProxy gets (any replica answers): ``ok``, or
        ``degraded`` with the registry's problem (200 either way: serving goes on)."""
        return self.registry_health().body()

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (refused := await refusal(self._keys, request)) is not None:
            return refused
        return model_list(self.config.model, self._created, self._front.limits.max_model_len)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        if self.runtime is not None:
            self.runtime.drain()  # the engine's latest token intervals, not a second old
        text = self._metrics.render(self.runtime_metrics.registry)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ---- generation ------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        received_ns = time.time_ns()
        ticket = RouteTicket.from_headers(request.headers)
        try:
            tenant = await request_tenant(self._keys, request)  # before the body is read
            return await self._respond(request, chat, ticket, received_ns, tenant)
        except APIError as exc:
            self._metrics.error(exc.status)
            if ticket is not None and self.progress is not None:
                # The router counted the request it routed here: it ends here (a request
                # that reached the engine was reported by ``generate`` already).
                self.progress.finished(ticket.request_id)
            return error_response(exc)

    async def _respond(
        self,
        request: Request,
        chat: bool,
        ticket: RouteTicket | None,
        received_ns: int,
        tenant: str,
    ) -> Response:
        front = self._front
        # Longer than HAProxy forwards to the router (it balanced the request blind), or than
        # the limit: refused before it is read.
        raw = await front.read(request)
        prepared = await front.prepare(raw, chat, tenant=tenant, headers=request.headers)
        # The total time counts from when the request entered the cluster (the router's clock).
        entered_ns = ticket.arrived_ns if ticket is not None and ticket.arrived_ns else received_ns
        waited_s = max(0, time.time_ns() - entered_ns) / 1e9
        deadline = front.limits.deadline(waited_s)
        # The router's decision is the spans' parent; the client's traceparent when there is none.
        context = trace_parent(ticket.trace_context if ticket else None, request.headers)
        generate = self._request(ticket, prepared, context)
        ids = prepared.prompt_token_ids
        slot = await charge(self._quotas, tenant, generate.request_id, len(ids))
        # TTFT counts from when the request entered the cluster (the router's clock).
        started_s = time.monotonic() - waited_s
        generation = Generation(
            _LocalStream(self.generate(generate)),
            self._decode,
            len(ids),
            prepared.stop_strings(),
            _noop,
            lambda: settle_soon(self._quotas, slot, generation.usage.completion_tokens),
            request=generate,
            started_s=started_s,
        )
        try:
            async with asyncio.timeout_at(deadline):
                await generation.first()
        except TimeoutError:  # not 503: another replica would not be faster
            raise timed_out(front.limits.timeout_s) from None
        except Exception as exc:  # nothing sent yet: 503 makes HAProxy try another replica
            logger.warning(
                "request %s failed before its first token: %s", generate.request_id, brief(exc)
            )
            message = f"the replica failed before the first token: {brief(exc)}"
            raise APIError(503, message, error_type="server_error", code=REPLICA_FAILED) from None
        self._metrics.first_token(generation)
        redispatched = ticket is not None and ticket.replica_id != self.replica_id
        headers = {
            REPLICA_HEADER: self.replica_id,
            RETRIES_HEADER: "1" if redispatched else "0",
            MATCHED_BLOCKS_HEADER: str(ticket.matched_blocks if ticket and not redispatched else 0),
            ROUTED_BY_HEADER: ticket.reason if ticket is not None else UNROUTED,
        }
        request_id = generate.request_id
        if prepared.stream:
            events = sse_events(
                generation,
                request_id,
                self.config.model,
                chat,
                prepared.include_usage,
                self._stream_failed(request_id),
                lambda: self._metrics.finished(generation),
            )
            bounded = until_deadline(events, deadline, self._stream_expired(request_id))
            return StreamingResponse(bounded, media_type="text/event-stream", headers=headers)
        try:
            async with asyncio.timeout_at(deadline):
                text, finish = await collect(generation)
        except TimeoutError:
            raise timed_out(front.limits.timeout_s) from None
        self._metrics.finished(generation)
        payload = full_body(request_id, self.config.model, chat, text, finish, generation)
        return JSONResponse(payload, headers=headers)

    def _request(
        self,
        ticket: RouteTicket | None,
        prepared: PreparedRequest,
        trace_context: dict[str, str] | None = None,
    ) -> GenerateRequest:
        """The engine request, with the router's decision when it was made for this replica.
        The router keyed the same body with the same tokenizer and hasher: comparing its key's
        digest with ours is the check (a mismatch means the two disagree, and routing is
        blind)."""
        ids, key, sampling = prepared.prompt_token_ids, prepared.key, prepared.sampling
        tenant, priority = prepared.tenant, prepared.priority
        if ticket is None:
            self._metrics.unrouted.inc()
            request_id = new_request_id(prepared.chat)
            return GenerateRequest(
                request_id,
                ids,
                key,
                sampling,
                trace_context=trace_context,
                tenant=tenant,
                priority=priority,
            )
        if ticket.key_digest and ticket.key_digest != key_digest(key):
            self._metrics.key_mismatches.inc()
            logger.warning("request %s: the router keyed another prompt", ticket.request_id)
        mine = ticket.replica_id == self.replica_id
        if not mine:
            self._metrics.redispatched.inc()
            # A hold (and the blocks it matched) was meant for the replica the router chose.
            ticket = dataclasses.replace(ticket, hold=None, matched_blocks=0)
        return GenerateRequest(
            ticket.request_id,
            ids,
            key,
            sampling,
            ticket=ticket,
            trace_context=trace_context,
            tenant=tenant,
            priority=priority,
        )

    def _stream_failed(self, request_id: str) -> Any:
        def failed(exc: BaseException) -> APIError:
            logger.warning("stream %s failed mid-stream: %s", request_id, brief(exc))
            self._metrics.stream_errors.inc()
            return mid_stream_error(exc)

        return failed

    def _stream_expired(self, request_id: str) -> Any:
        def expired() -> APIError:
            logger.warning("stream %s ran past the request timeout", request_id)
            self._metrics.stream_errors.inc()
            return timed_out(self._front.limits.timeout_s)

        return expired
