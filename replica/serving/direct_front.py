"""The direct path's OpenAI API on a replica, apart from Serve: ``DirectFront`` turns each
request HAProxy forwards into the replica's engine stream and renders what comes back;
``openai_server.py``'s deployment builds one and its routes call it. Built through its
constructor over any ``ServedReplica`` (tests pass a fake).

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
error event. Every error is OpenAI JSON (``api/errors.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry

from prefixmesh.api.auth import ApiKeys, refusal, request_tenant
from prefixmesh.api.errors import APIError, error_response
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
from prefixmesh.cache_registry.registry_health import RegistryHealth
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.replica.serving.node_metrics import MetricsSource, node_metrics, node_or_own
from prefixmesh.replica.serving.spans import trace_parent
from prefixmesh.wire import GenerateChunk, GenerateRequest
from prefixmesh.wire.route_ticket import RouteTicket, key_digest

logger = logging.getLogger(__name__)


class ServedReplica(Protocol):
    """What the direct path's API needs of its replica (``ReplicaCore`` in
    ``deployment.py``)."""

    @property
    def replica_id(self) -> str: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...

    def unserved(self, request_id: str) -> None: ...

    def registry_health(self) -> RegistryHealth: ...

    def runtime_registry(self) -> CollectorRegistry: ...


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


class DirectFront:
    """The direct path's API over one replica: the front door, the error and stream
    rendering, API keys and quotas, and the request metrics of this replica."""

    def __init__(
        self,
        replica: ServedReplica,
        front: FrontDoor,
        decode: Callable[[Sequence[int]], str],
        *,
        metrics: DirectMetrics | None = None,
        keys: ApiKeys | None = None,
        quotas: TenantQuotas | None = None,
        created: int = 0,
        node: MetricsSource | None = None,
    ) -> None:
        """``front``: the model, limits, tokenizer and hasher the router uses too;
        ``decode``: token ids to text; ``keys`` and ``quotas``: None when off; ``created``:
        the model list's timestamp; ``node``: where ``/metrics`` reads the node's whole view
        (None: this replica's own)."""
        self._replica = replica
        self._front = front
        self._model = front.model
        self._decode = decode
        self.metrics = metrics or DirectMetrics()
        self._keys = keys
        self._quotas = quotas
        self._created = created
        self._node = node

    @classmethod
    def from_config(
        cls, config: PrefixmeshConfig, model_path: str, replica: ServedReplica
    ) -> DirectFront:
        """As the deployment builds it: the model's own tokenizer, the config's limits, keys
        and quotas."""
        from transformers import AutoTokenizer

        encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_path))
        limits = RequestLimits.from_config(config, encoder.hf)
        metrics = DirectMetrics()
        return cls(
            replica,
            FrontDoor(config.model, limits, encoder, make_hasher(config)),
            encoder.decode,
            metrics=metrics,
            keys=ApiKeys.from_config(config),
            quotas=TenantQuotas.from_config(config, metrics),
            created=int(time.time()),
            node=node_metrics(config.metrics.export_port),
        )

    async def close(self) -> None:
        if self._quotas is not None:
            await self._quotas.close()

    def health(self) -> dict[str, str]:
        """``ok``, or ``degraded`` with the registry's problem (200 either way: serving goes
        on)."""
        return self._replica.registry_health().body()

    async def models(self, request: Request) -> Any:
        if (refused := await refusal(self._keys, request)) is not None:
            return refused
        return model_list(self._model, self._created, self._front.limits.max_model_len)

    async def metrics_text(self) -> Response:
        """The node's metrics (every serving process's, labelled), else this replica's."""
        own = self.metrics.render(self._replica.runtime_registry())
        text = await node_or_own(self._node, own)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def serve(self, request: Request, chat: bool) -> Response:
        received_ns = time.time_ns()
        ticket = RouteTicket.from_headers(request.headers)
        try:
            tenant = await request_tenant(self._keys, request)  # before the body is read
            return await self._respond(request, chat, ticket, received_ns, tenant)
        except APIError as exc:
            self.metrics.error(exc.status)
            if ticket is not None:
                self._replica.unserved(ticket.request_id)
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
            _LocalStream(self._replica.generate(generate)),
            self._decode,
            len(ids),
            prepared.stop_strings(),
            _noop,
            lambda: settle_soon(self._quotas, slot, generation.usage.completion_tokens),
            request=generate,
            started_s=started_s,
            choices=prepared.sampling.n,
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
        self.metrics.first_token(generation)
        redispatched = ticket is not None and ticket.replica_id != self._replica.replica_id
        headers = {
            REPLICA_HEADER: self._replica.replica_id,
            RETRIES_HEADER: "1" if redispatched else "0",
            MATCHED_BLOCKS_HEADER: str(ticket.matched_blocks if ticket and not redispatched else 0),
            ROUTED_BY_HEADER: ticket.reason if ticket is not None else UNROUTED,
        }
        request_id = generate.request_id
        if prepared.stream:
            events = sse_events(
                generation,
                request_id,
                self._model,
                chat,
                prepared.include_usage,
                self._stream_failed(request_id),
                lambda: self.metrics.finished(generation),
            )
            bounded = until_deadline(events, deadline, self._stream_expired(request_id))
            return StreamingResponse(bounded, media_type="text/event-stream", headers=headers)
        try:
            async with asyncio.timeout_at(deadline):
                outputs = await collect(generation)
        except TimeoutError:
            raise timed_out(front.limits.timeout_s) from None
        self.metrics.finished(generation)
        payload = full_body(request_id, self._model, chat, outputs, generation)
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
        if ticket is None:
            self.metrics.unrouted.inc()
            return prepared.engine_request(
                new_request_id(prepared.chat), trace_context=trace_context
            )
        if ticket.key_digest and ticket.key_digest != key_digest(prepared.key):
            self.metrics.key_mismatches.inc()
            logger.warning("request %s: the router keyed another prompt", ticket.request_id)
        mine = ticket.replica_id == self._replica.replica_id
        if not mine:
            self.metrics.redispatched.inc()
            # A hold (and the blocks it matched) was meant for the replica the router chose.
            ticket = dataclasses.replace(ticket, hold=None, matched_blocks=0)
        return prepared.engine_request(
            ticket.request_id, ticket=ticket, trace_context=trace_context
        )

    def _stream_failed(self, request_id: str) -> Any:
        def failed(exc: BaseException) -> APIError:
            logger.warning("stream %s failed mid-stream: %s", request_id, brief(exc))
            self.metrics.stream_errors.inc()
            return mid_stream_error(exc)

        return failed

    def _stream_expired(self, request_id: str) -> Any:
        def expired() -> APIError:
            logger.warning("stream %s ran past the request timeout", request_id)
            self.metrics.stream_errors.inc()
            return timed_out(self._front.limits.timeout_s)

        return expired
