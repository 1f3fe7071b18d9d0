"""The ingress: the OpenAI-compatible HTTP API on Ray Serve (FastAPI).

It validates, applies the chat template, tokenizes and hashes the prompt once, and hands token
ids and block keys to the replicas through a handle whose request router is ours. In the
in-process registry mode it also receives the replicas' cache events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from prefixmesh import tracing
from prefixmesh.cache_registry.factory import make_hasher, make_memory_state
from prefixmesh.cache_registry.types import CacheEvent, PublishResult
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.generation import Generation, TextDelta
from prefixmesh.router.local_state import local_state
from prefixmesh.router.metrics import IngressMetrics
from prefixmesh.router.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from prefixmesh.router.retry import AttemptFailed, retry_request, run_with_retry
from prefixmesh.router.spans import NoRequestTrace, request_trace
from prefixmesh.wire import GenerateRequest

logger = logging.getLogger(__name__)
api = FastAPI(title="prefixmesh", docs_url=None, redoc_url=None)
REPLICA_HEADER = "x-prefixmesh-replica"
RETRIES_HEADER = "x-prefixmesh-retries"
MATCHED_BLOCKS_HEADER = "x-prefixmesh-matched-blocks"
REPLICA_FAILED = "replica_failed"
"""The ``code`` of the error event that ends a stream whose replica failed mid-stream."""


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _brief(exc: BaseException) -> str:
    """An exception as one line: Ray wraps remote errors with whole tracebacks."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


async def _started(generation: Generation) -> tuple[str, str] | None:
    """A streamed response needs nothing more than its first token before it is sent."""
    del generation
    return None


def _failure(request_id: str, failed: AttemptFailed) -> APIError:
    """The HTTP error of a request that failed for good."""
    cause = failed.cause
    if isinstance(cause, APIError):
        return cause
    if failed.phase == "before_first_token":
        logger.warning("request %s failed before its first token: %s", request_id, _brief(cause))
        message = f"no replica could serve the request: {_brief(cause)}"
        return APIError(503, message, error_type="server_error", code=REPLICA_FAILED)
    logger.warning("request %s failed mid-generation: %s", request_id, _brief(cause))
    message = f"the replica failed mid-generation: {_brief(cause)}"
    return APIError(502, message, error_type="server_error", code=REPLICA_FAILED)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@serve.ingress(api)
class IngressServer:
    def __init__(self, replicas: Any, config_json: str, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.config = PrefixmeshConfig.model_validate_json(config_json)
        config = self.config
        tracing.setup(config.telemetry, "ingress")  # the request router shares this process
        self._replicas = replicas
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._hasher = make_hasher(config)
        self._local = local_state(config.app_name, lambda: make_memory_state(config))
        self._metrics = IngressMetrics()
        self._max_model_len = config.replica.vllm.max_model_len
        self._created = int(time.time())

    # ---- small endpoints -------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.config.model,
            "object": "model",
            "created": self._created,
            "owned_by": "prefixmesh",
            "max_model_len": self._max_model_len,
        }
        return {"object": "list", "data": [card]}

    @api.get("/metrics")
    async def metrics(self) -> Response:
        router = self._local.metrics
        with self._local.lock:
            router.ongoing.set(len(self._local.ledger))
        body = self._metrics.render(router)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    # ---- generation ------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrived_ns = time.time_ns()
        try:
            body = parse_body(await request.body(), CompletionRequest)
            self._check_model(body.model)
            ids = await self._tokenize_prompt(body.prompt)
            return await self._respond(
                body,
                ids,
                body.max_tokens,
                chat=False,
                headers=request.headers,
                arrived_ns=arrived_ns,
            )
        except APIError as exc:
            self._metrics.error(exc.status)
            return _error(exc)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrived_ns = time.time_ns()
        try:
            body = parse_body(await request.body(), ChatCompletionRequest)
            self._check_model(body.model)
            ids = await self._tokenize_chat(body)
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self._respond(
                body, ids, max_tokens, chat=True, headers=request.headers, arrived_ns=arrived_ns
            )
        except APIError as exc:
            self._metrics.error(exc.status)
            return _error(exc)

    def _check_model(self, model: str) -> None:
        if model != self.config.model:
            raise APIError(
                404,
                f"model {model!r} does not exist; this cluster serves {self.config.model!r}",
                param="model",
                code="model_not_found",
            )

    async def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < len(self._tokenizer) for t in prompt):
                raise APIError(422, "prompt token ids out of the vocabulary", param="prompt")
            return list(prompt)
        # Tokenizing a long prompt takes milliseconds of CPU: off the event loop.
        return list(await asyncio.to_thread(lambda: self._tokenizer(prompt)["input_ids"]))

    async def _tokenize_chat(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]

        def render() -> list[int]:
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding (a UserDict)
                ids = ids["input_ids"]
            return [int(t) for t in ids]

        return await asyncio.to_thread(render)

    async def _respond(
        self,
        body: Any,
        ids: list[int],
        max_tokens: int | None,
        *,
        chat: bool,
        headers: Mapping[str, str],
        arrived_ns: int,
    ) -> Response:
        """The response, inside the request's span (which a stream ends when it ends)."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        trace = request_trace(headers, request_id, len(ids), bool(body.stream), arrived_ns)
        try:
            return await self._respond_traced(body, ids, max_tokens, chat, request_id, trace)
        except BaseException as exc:
            trace.end(error=exc)
            raise

    async def _respond_traced(
        self,
        body: Any,
        ids: list[int],
        max_tokens: int | None,
        chat: bool,
        request_id: str,
        trace: NoRequestTrace,
    ) -> Response:
        sampling = body.engine_sampling(
            len(ids), max_tokens, self._max_model_len, self._tokenizer.eos_token_id
        )
        key = self._hasher.hash_tokens(ids)
        generate = GenerateRequest(
            request_id, tuple(ids), key.block_hashes, sampling, trace_context=trace.carrier
        )
        stop = body.stop_strings()
        started_s = time.monotonic()

        def start(avoid: tuple[str, ...], attempt: int) -> Generation:
            # A retry is a fresh request: no hold or decision of the failed attempt carries
            # over, and its trace context is the request span's again (the router replaced it).
            request = (
                retry_request(generate, attempt, avoid, trace.carrier) if attempt else generate
            )
            return self._start(request, stop, started_s)

        def retried(phase: str, exc: BaseException) -> None:
            self._metrics.retried(phase, type(exc).__name__)
            trace.retried(phase, exc)

        # A stream is retried only until its first token: after that the client has output.
        finish = _started if body.stream else self._collect
        try:
            done = await run_with_retry(
                start,
                finish,
                retries=self.config.ingress.retries,
                replica_of=lambda g: g.routed_to,
                on_retry=retried,
            )
        except AttemptFailed as failed:
            raise _failure(request_id, failed) from None
        generation = done.generation
        self._metrics.first_token(generation)
        trace.answered(generation, done.retries)
        headers = {
            REPLICA_HEADER: generation.replica_id,
            RETRIES_HEADER: str(done.retries),
            MATCHED_BLOCKS_HEADER: str(
                generation.request.matched_blocks if generation.request else 0
            ),
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(generation, request_id, chat, include_usage, trace)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        text, finish_reason = done.result or ("", "stop")
        self._metrics.finished(generation)
        trace.end(generation)
        return JSONResponse(
            self._full_body(request_id, chat, text, finish_reason, generation), headers=headers
        )

    def _start(self, request: GenerateRequest, stop: list[str], started_s: float) -> Generation:
        ledger, lock = self._local.ledger, self._local.lock

        def first_token() -> None:
            with lock:
                ledger.first_token(request.request_id)

        def end() -> None:
            with lock:
                ledger.finished(request.request_id)

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
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    async def _collect(self, generation: Generation) -> tuple[str, str]:
        """The whole output; a replica failure is raised as it is (the retry judges it)."""
        parts: list[str] = []
        finish = "stop"
        try:
            async with asyncio.timeout(self.config.ingress.request_timeout_s):
                async for delta in generation.deltas():
                    parts.append(delta.text)
                    finish = delta.finish_reason or finish
        except TimeoutError:
            raise APIError(504, "the request timed out", error_type="server_error") from None
        return "".join(parts), finish

    async def _stream(
        self,
        generation: Generation,
        request_id: str,
        chat: bool,
        include_usage: bool,
        trace: NoRequestTrace,
    ) -> AsyncIterator[bytes]:
        base = {
            "id": request_id,
            "created": int(time.time()),
            "model": self.config.model,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        if chat:
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ],
                }
            )
        try:
            async for delta in generation.deltas():
                yield _sse({**base, "choices": [self._choice_delta(delta, chat)]})
        except Exception as exc:  # the replica died mid-stream: say so, then end the stream
            logger.warning("stream %s failed mid-stream: %s", request_id, _brief(exc))
            self._metrics.stream_errors.inc()
            error = APIError(
                502,
                f"the replica failed mid-stream: {_brief(exc)}",
                error_type="server_error",
                code=REPLICA_FAILED,
            )
            trace.end(generation, error)
            yield _sse(error.body())
        else:
            if include_usage:
                yield _sse({**base, "choices": [], "usage": generation.usage.as_dict()})
            self._metrics.finished(generation)
        finally:
            trace.end(generation)  # a client gone mid-stream ends it here (idempotent)
        yield _sse("[DONE]")

    @staticmethod
    def _choice_delta(delta: TextDelta, chat: bool) -> dict[str, Any]:
        if chat:
            content = {"content": delta.text} if delta.text else {}
            return {"index": 0, "delta": content, "finish_reason": delta.finish_reason}
        return {
            "index": 0,
            "text": delta.text,
            "logprobs": None,
            "finish_reason": delta.finish_reason,
        }

    def _full_body(
        self, request_id: str, chat: bool, text: str, finish: str, generation: Generation
    ) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": request_id,
            "created": int(time.time()),
            "model": self.config.model,
            "usage": generation.usage.as_dict(),
        }
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "text_completion", "choices": [choice]}

    # ---- cluster plumbing ------------------------------------------------------------------

    async def ingest_cache_events(self, events: list[CacheEvent]) -> list[PublishResult]:
        """In-process registry mode: replicas send their cache events here."""
        with self._local.lock:
            return self._local.registry.publish(events)

    @api.get("/admin/registry")
    async def registry_replicas(self) -> dict[str, Any]:
        """The replicas the in-process registry has entries for (memory backend only; with
        Redis the registry is shared and inspected there): for tests and operators."""
        if self.config.registry.backend != "memory":
            return {"backend": self.config.registry.backend, "replicas": None}
        with self._local.lock:
            replicas = sorted(self._local.registry.sequences)
        return {"backend": "memory", "replicas": replicas}

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
