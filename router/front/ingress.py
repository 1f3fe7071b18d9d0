"""The ingress: the OpenAI-compatible HTTP API on Ray Serve (FastAPI).

It prepares the request once through the front door (``api/prepare.py``: validation, chat
template, tokens, sampling, key, priority), charges its tenant's quota, and hands token ids and
block keys to the replicas through a handle whose request router is ours. In the
in-process registry mode it also receives the replicas' cache events.

Limits come before work (``api/limits.py``): a body over ``limits.max_body_bytes`` is refused
before it is read, a prompt that cannot fit the context before it is tokenized, and a request
that outlives ``ingress.request_timeout_s`` (retries and streams included) ends with a 504 or,
streaming, an error event. Every error is OpenAI JSON (``api/errors.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from prefixmesh import tracing
from prefixmesh.api.auth import ApiKeys, refusal, request_tenant
from prefixmesh.api.errors import APIError, error_response, install_error_handlers
from prefixmesh.api.generation import Generation
from prefixmesh.api.limits import RequestLimits, timed_out, until_deadline
from prefixmesh.api.prepare import FrontDoor, PreparedRequest, new_request_id
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.api.quota import QuotaSlot, TenantQuotas, charge, settle_soon
from prefixmesh.api.render import (
    MATCHED_BLOCKS_HEADER,
    REPLICA_FAILED,
    REPLICA_HEADER,
    RETRIES_HEADER,
    ChoiceOutput,
    brief,
    collect,
    full_body,
    mid_stream_error,
    model_list,
    sse_events,
)
from prefixmesh.api.request_metrics import RequestMetrics
from prefixmesh.cache_registry.factory import (
    make_hasher,
    make_memory_state,
    make_registry_probe,
)
from prefixmesh.cache_registry.types import CacheEvent, PublishResult
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.core.local_state import local_state
from prefixmesh.router.core.spans import NoRequestTrace, request_trace
from prefixmesh.router.front.registry_watch import RegistryWatch
from prefixmesh.router.front.retry import AttemptFailed, retry_request, run_with_retry
from prefixmesh.wire import GenerateRequest, RouteTicket

logger = logging.getLogger(__name__)
api = install_error_handlers(
    FastAPI(title="prefixmesh", docs_url=None, redoc_url=None, redirect_slashes=False)
)


async def _started(generation: Generation) -> list[ChoiceOutput] | None:
    """A streamed response needs nothing more than its first token before it is sent."""
    del generation
    return None


def _failure(request_id: str, failed: AttemptFailed) -> APIError:
    """The HTTP error of a request that failed for good."""
    cause = failed.cause
    if isinstance(cause, APIError):
        return cause
    if failed.phase == "before_first_token":
        logger.warning("request %s failed before its first token: %s", request_id, brief(cause))
        message = f"no replica could serve the request: {brief(cause)}"
        return APIError(503, message, error_type="server_error", code=REPLICA_FAILED)
    logger.warning("request %s failed mid-generation: %s", request_id, brief(cause))
    message = f"the replica failed mid-generation: {brief(cause)}"
    return APIError(502, message, error_type="server_error", code=REPLICA_FAILED)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One accepted request's own values on its way through the ingress."""

    request_id: str
    arrived_ns: int
    """Wall-clock arrival (the request span starts there)."""
    deadline: float
    """The event loop's time the request must end by (retries and streams included)."""
    slot: QuotaSlot | None
    """Its tenant's quota charge, settled when it ends (None: no quotas)."""


@serve.ingress(api)
class IngressServer:
    def __init__(self, replicas: Any, config_json: str, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.config = PrefixmeshConfig.model_validate_json(config_json)
        config = self.config
        tracing.setup(config.telemetry, "ingress")  # the request router shares this process
        self._replicas = replicas
        encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_path))
        limits = RequestLimits.from_config(config, encoder.hf)
        self._front = FrontDoor(config.model, limits, encoder, make_hasher(config))
        self._decode = encoder.decode
        self._local = local_state(config.app_name, lambda: make_memory_state(config))
        self._registry_watch = RegistryWatch(make_registry_probe(config), self._local.metrics)
        self._metrics = RequestMetrics()
        self._keys = ApiKeys.from_config(config)
        self._quotas = TenantQuotas.from_config(config, self._metrics)
        self._created = int(time.time())

    # ---- small endpoints -------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        """``{"status": "ok"}`` or ``degraded`` with the registry's problem (``RegistryWatch``)."""
        return await self._registry_watch.health()

    async def check_health(self) -> None:
        """Serve's periodic check (``ingress.health_check_period_s``): refreshes the registry's
        health and never fails for it."""
        await self._registry_watch.refresh()

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (refused := await refusal(self._keys, request)) is not None:
            return refused
        return model_list(self.config.model, self._created, self._front.limits.max_model_len)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        body = self._metrics.render(self._local.metrics_now().registry)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    # ---- generation ------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        arrived_ns = time.time_ns()
        front = self._front
        try:
            tenant = await request_tenant(self._keys, request)  # before the body is read
            raw = await front.read(request)  # a body over the limit is not read
            prepared = await front.prepare(raw, chat, tenant=tenant, headers=request.headers)
            deadline = front.limits.deadline((time.time_ns() - arrived_ns) / 1e9)
            request_id = new_request_id(chat)
            # Last before the response: an admitted request is settled when it ends.
            slot = await charge(self._quotas, tenant, request_id, prepared.prompt_tokens)
            context = RequestContext(request_id, arrived_ns, deadline, slot)
            return await self._respond(prepared, context, request.headers)
        except APIError as exc:
            self._metrics.error(exc.status)
            return error_response(exc)

    async def _respond(
        self, prepared: PreparedRequest, context: RequestContext, headers: Mapping[str, str]
    ) -> Response:
        """The response, inside the request's span (which a stream ends when it ends)."""
        trace = request_trace(
            headers,
            context.request_id,
            prepared.prompt_tokens,
            prepared.stream,
            context.arrived_ns,
        )
        try:
            return await self._respond_traced(prepared, context, trace)
        except BaseException as exc:
            trace.end(error=exc)
            self._settle(context.slot, None)
            raise

    async def _respond_traced(
        self, prepared: PreparedRequest, context: RequestContext, trace: NoRequestTrace
    ) -> Response:
        """``context.deadline``: the event loop's time the request must end by (retries,
        streams)."""
        request_id, deadline = context.request_id, context.deadline
        generate = prepared.engine_request(request_id, trace_context=trace.carrier)
        stop = prepared.stop_strings()
        started_s = time.monotonic()

        def start(avoid: tuple[str, ...], attempt: int) -> Generation:
            # A retry is a fresh request under a new id, decided afresh.
            request = retry_request(generate, attempt, avoid) if attempt else generate
            return self._start(request, stop, started_s)

        def retried(phase: str, exc: BaseException) -> None:
            self._metrics.retried(phase, type(exc).__name__)
            trace.retried(phase, exc)

        # A stream is retried only until its first token: after that the client has output.
        # A replica failure while collecting is raised as it is (the retry judges it).
        finish = _started if prepared.stream else collect
        try:
            # Past the deadline the attempt is cancelled, which closes its generation (the
            # replica aborts the request).
            async with asyncio.timeout_at(deadline):
                done = await run_with_retry(
                    start,
                    finish,
                    retries=self.config.ingress.retries,
                    replica_of=lambda g: g.routed_to,
                    on_retry=retried,
                )
        except TimeoutError:
            raise timed_out(self._front.limits.timeout_s) from None
        except AttemptFailed as failed:
            raise _failure(request_id, failed) from None
        generation = done.generation
        self._metrics.first_token(generation)
        trace.answered(generation, done.retries)
        headers = {
            REPLICA_HEADER: generation.replica_id,
            RETRIES_HEADER: str(done.retries),
            MATCHED_BLOCKS_HEADER: str(
                generation.ticket.matched_blocks if generation.ticket else 0
            ),
        }
        chat = prepared.chat
        if prepared.stream:
            stream = self._stream(
                generation, request_id, chat, prepared.include_usage, trace, deadline, context.slot
            )
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        outputs = done.result or [ChoiceOutput("")]
        self._metrics.finished(generation)
        trace.end(generation)
        self._settle(context.slot, generation)
        body_json = full_body(request_id, self.config.model, chat, outputs, generation)
        return JSONResponse(body_json, headers=headers)

    def _settle(self, slot: QuotaSlot | None, generation: Generation | None) -> None:
        """The request ended (``generation`` None: before any replica answered)."""
        tokens = generation.usage.completion_tokens if generation is not None else 0
        settle_soon(self._quotas, slot, tokens)

    def _start(self, request: GenerateRequest, stop: list[str], started_s: float) -> Generation:
        ledger, lock = self._local.ledger, self._local.lock

        def first_token() -> None:
            with lock:
                ledger.first_token(request.request_id)

        def end() -> None:
            with lock:
                ledger.finished(request.request_id)

        def routed() -> RouteTicket | None:  # the request router's decision, taken once
            with lock:
                ticket: RouteTicket | None = self._local.take_ticket(request.request_id)
            return ticket

        stream = self._replicas.options(stream=True).generate.remote(request)
        return Generation(
            stream,
            self._decode,
            len(request.prompt_token_ids),
            stop,
            first_token,
            end,
            request=request,
            started_s=started_s,
            routed=routed,
            choices=request.sampling.n,
        )

    async def _stream(
        self,
        generation: Generation,
        request_id: str,
        chat: bool,
        include_usage: bool,
        trace: NoRequestTrace,
        deadline: float,
        slot: QuotaSlot | None,
    ) -> AsyncIterator[bytes]:
        def failed(exc: BaseException) -> APIError:  # the replica died mid-stream
            logger.warning("stream %s failed mid-stream: %s", request_id, brief(exc))
            self._metrics.stream_errors.inc()
            error = mid_stream_error(exc)
            trace.end(generation, error)
            return error

        def expired() -> APIError:
            logger.warning("stream %s ran past the request timeout", request_id)
            self._metrics.stream_errors.inc()
            error = timed_out(self._front.limits.timeout_s)
            trace.end(generation, error)
            return error

        events = sse_events(
            generation,
            request_id,
            self.config.model,
            chat,
            include_usage,
            failed,
            lambda: self._metrics.finished(generation),
        )
        try:
            async for event in until_deadline(events, deadline, expired):
                yield event
        finally:
            trace.end(generation)  # a client gone mid-stream ends it here (idempotent)
            self._settle(slot, generation)

    # ---- cluster plumbing ------------------------------------------------------------------

    async def ingest_cache_events(self, events: list[CacheEvent]) -> list[PublishResult]:
        """In-process registry mode: replicas send their cache events here."""
        return self._local.publish(events)

    @api.get("/admin/registry")
    async def registry_replicas(self) -> dict[str, Any]:
        """The replicas the in-process registry has entries for (memory backend only; with
        Redis the registry is shared and inspected there): for tests and operators."""
        if self.config.registry.backend != "memory":
            return {"backend": self.config.registry.backend, "replicas": None}
        return {"backend": "memory", "replicas": self._local.registry_replicas()}

    @api.get("/admin/traces")
    async def traces(self) -> list[dict[str, Any]]:
        """Spans finished in this process, the ingress's and its request router's
        (``telemetry.tracing=memory``; else []); a replica's come from its ``exported_spans``."""
        return tracing.finished_spans()

    @api.get("/admin/replicas")
    async def replica_stats(self) -> list[dict[str, Any]]:
        """Each replica's latest report (load, prefix-cache counters, holds, events), as Serve
        polls it every ``replica.routing_stats_period_s``: for tests and benchmarks."""
        return self._local.replica_stats()
