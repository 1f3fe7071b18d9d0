"""``prefixmesh replica-server``: one replica's engine behind HTTP on 127.0.0.1, no Ray Serve.

Any router can sit in front of a fleet of these (``prefixmesh compare`` puts the peer routers
and ours in front of them in turn). Each serves the OpenAI API (completions and chat, streaming,
``usage.prompt_tokens_details.cached_tokens``), its prefix-cache counters on
``/metrics`` in vLLM's names, and what the peer routers ask a worker for: ``/health``,
``/v1/models``, vLLM's ``/tokenize`` and ``/v1/completions/render`` (vllm-router's
``cache_aware`` calls one of them on every worker for every request), SGLang's
``/get_server_info``, ``/get_model_info``, ``/get_load`` and ``/flush_cache``;
``/reset_prefix_cache`` clears the cache between runs. ``/engine/*`` is the remote engine's
native protocol (``replica/serving/engine_server.py``), through which Ray Serve replicas forward
here.

The engine is the replica's own (``replica/engines/``: sim or vLLM, built by the replica
deployment's ``make_engine``); the request is prepared by the front door every server uses
(``api/prepare.py``: the same parsing, model check, tokens with their vocabulary check,
sampling), and rendering, detokenization and stop strings are the shared ones
(``prefixmesh/api/``), and so are the limits checked before work
(``api/limits.py``: body size, prompt size, ``max_tokens``, the request's total time), the
OpenAI JSON of every error (``api/errors.py``) and the API keys (``api/auth.py``), which
guard the OpenAI API under ``/v1`` as vLLM's ``--api-key`` does. Token quotas are the cluster's
(its replicas and routers count them); this server has none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixmesh.api.auth import ApiKeys, refusal
from prefixmesh.api.errors import APIError, error_response, install_error_handlers
from prefixmesh.api.generation import Generation
from prefixmesh.api.limits import RequestLimits, read_json, timed_out, until_deadline
from prefixmesh.api.prepare import FrontDoor, new_request_id
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.api.render import REPLICA_HEADER, collect, full_body, model_list, sse_events
from prefixmesh.api.word_vocabulary import Vocabulary, fast_encode, word_lookup
from prefixmesh.cache_registry.factory import make_hasher
from prefixmesh.cache_registry.types import PrefixKey
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.replica.engines.base import EngineChunk, EngineRequest
from prefixmesh.replica.engines.choices import choice_chunks
from prefixmesh.replica.serving.engine_server import EngineHost, engine_routes
from prefixmesh.wire import GenerateChunk

logger = logging.getLogger(__name__)


class PromptTokenizer(PromptEncoder):
    """The model's tokenizer, with an exact shortcut for the load generator's text
    (single-token words, ``api/word_vocabulary.py``): a 2,000-token prompt tokenizes in ~0.4 ms
    instead of ~10 ms, which matters when vllm-router asks every replica to tokenize every
    request on two cores."""

    def __init__(self, tokenizer: Any, vocabulary: Vocabulary | None) -> None:
        super().__init__(tokenizer)
        self._lookup = word_lookup(vocabulary) if vocabulary is not None else {}
        self._bos = vocabulary.bos_id if vocabulary is not None else None

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str) and self._lookup:
            fast = fast_encode(prompt, self._lookup, self._bos)
            if fast is not None:
                return fast
        return await super().encode(prompt)


@dataclasses.dataclass(frozen=True)
class _Unkeyed:
    """The front door's hasher for a server whose engine takes no key: every prompt's key is
    empty, and hashing costs nothing on this CPU-bound path."""

    block_size: int

    def hash_tokens(self, token_ids: Sequence[int]) -> PrefixKey:
        return PrefixKey((), self.block_size)


class _EngineStream:
    """An engine's output in the shape ``Generation`` reads (a Serve stream's)."""

    def __init__(self, chunks: AsyncIterator[EngineChunk], replica_id: str) -> None:
        self._chunks = chunks
        self._replica_id = replica_id
        self._closing: asyncio.Task[None] | None = None

    async def __anext__(self) -> GenerateChunk:
        chunk = await self._chunks.__anext__()
        return GenerateChunk(
            chunk.token_ids,
            chunk.finished,
            chunk.finish_reason,
            chunk.num_cached_tokens,
            self._replica_id,
            index=chunk.index,
        )

    def cancel(self) -> None:
        # Closing the engine's generator aborts the request there (and frees its KV).
        close = getattr(self._chunks, "aclose", None)
        if close is not None and self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(close())


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


class ReplicaService:
    """The OpenAI API and the worker APIs the peers probe, over one ``EngineHost``."""

    def __init__(
        self,
        config: PrefixmeshConfig,
        host: EngineHost,
        tokenizer: PromptTokenizer,
        *,
        engine_kind: str,
        model_dir: str,
    ) -> None:
        self.config = config
        self.host = host
        self.tokenizer = tokenizer
        self.engine_kind = engine_kind
        self.model_dir = model_dir
        hasher = make_hasher(config)
        self.fingerprint = hasher.fingerprint.to_json()
        self.max_model_len = config.replica.vllm.max_model_len
        limits = RequestLimits.from_config(config, tokenizer.hf)
        # The router in front of this server keys prompts itself; its engine needs no key.
        unkeyed = _Unkeyed(hasher.block_size)
        self.front = FrontDoor(config.model, limits, tokenizer, unkeyed, "this replica")
        self.started = time.time()

    @property
    def limits(self) -> RequestLimits:
        return self.front.limits

    @property
    def replica_id(self) -> str:
        return self.host.replica_id

    # ---- generation --------------------------------------------------------------------------

    async def respond(self, raw: bytes, chat: bool, deadline: float) -> Response:
        """``raw``: the body ``front.read`` returned; ``deadline``: the event loop's time the
        request must end by."""
        prepared = await self.front.prepare(raw, chat)
        ids, sampling = prepared.prompt_token_ids, prepared.sampling
        request_id = new_request_id(chat)
        request = EngineRequest(request_id, ids, sampling)
        stream = _EngineStream(choice_chunks(self.host.generate, request), self.replica_id)
        generation = Generation(
            stream,
            self.tokenizer.decode,
            len(ids),
            prepared.stop_strings(),
            _nothing,
            _nothing,
            choices=sampling.n,
        )
        try:
            async with asyncio.timeout_at(deadline):
                await generation.first()
        except TimeoutError:
            raise timed_out(self.limits.timeout_s) from None
        except Exception as exc:
            logger.exception("request %s failed before its first token", request_id)
            raise APIError(503, f"the engine failed: {exc}", error_type="server_error") from None
        headers = {REPLICA_HEADER: self.replica_id}
        if prepared.stream:
            events = sse_events(
                generation,
                request_id,
                self.config.model,
                chat,
                prepared.include_usage,
                _engine_failed,
            )
            bounded = until_deadline(events, deadline, self._expired)
            return StreamingResponse(bounded, media_type="text/event-stream", headers=headers)
        try:
            async with asyncio.timeout_at(deadline):
                outputs = await collect(generation)
        except TimeoutError:
            raise timed_out(self.limits.timeout_s) from None
        body_json = full_body(request_id, self.config.model, chat, outputs, generation)
        return JSONResponse(body_json, headers=headers)

    def _expired(self) -> APIError:
        logger.warning("a stream ran past the request timeout")
        return timed_out(self.limits.timeout_s)

    # ---- what the remote engine and the peers ask for -----------------------------------------

    def engine_info(self) -> dict[str, Any]:
        engine = self.host.live_engine
        return {
            "replica_id": self.replica_id,
            "engine": self.engine_kind,
            "fingerprint": self.fingerprint,
            "block_size": self.config.cache.block_size,
            "kv_blocks": engine.kv_blocks,
            "capacity": capacity.to_wire() if (capacity := engine.capacity()) else {},
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's /get_server_info. The model path is a local folder, so a router that loads
        a tokenizer for it (sglang-router does) reads it from disk, not from a model hub."""
        block = self.config.cache.block_size
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "served_model_name": self.config.model,
            "dp_size": 1,
            "tp_size": 1,
            "page_size": block,
            "max_total_num_tokens": self.host.live_engine.kv_blocks * block,
            "version": "prefixmesh-replica-server",
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "served_model_name": self.config.model,
        }

    def render(self, body: dict[str, Any], ids: list[int], prefix: str) -> dict[str, Any]:
        """vLLM's renderer API: a request's token ids, without generating."""
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex[:16]}",
            "token_ids": ids,
            "sampling_params": {"max_tokens": body.get("max_tokens")},
            "model": body.get("model") or self.config.model,
            "stream": bool(body.get("stream")),
            "stream_options": body.get("stream_options"),
            "token_offsets": None,
        }

    async def tokens_of(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a /tokenize or render body: ``prompt`` (text or ids) or ``messages``."""
        if "messages" in body:
            messages = [
                {"role": str(m.get("role", "user")), "content": _text(m.get("content"))}
                for m in body["messages"]
            ]
            return await self.tokenizer.encode_messages(messages)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        return await self.tokenizer.encode(_text(prompt))


def _nothing() -> None:
    return None


def _engine_failed(exc: BaseException) -> APIError:
    logger.error("stream failed: %s", exc)
    return APIError(502, f"the engine failed mid-stream: {exc}", error_type="server_error")


def build_app(service: ReplicaService) -> FastAPI:
    """The HTTP surface of one replica; the engine starts and stops with the app."""
    app = FastAPI(
        title="prefixmesh replica",
        docs_url=None,
        redoc_url=None,
        lifespan=_lifespan(service),
        redirect_slashes=False,
    )
    install_error_handlers(app)
    app.include_router(engine_routes(service.host, service.engine_info))
    keys = ApiKeys.from_config(service.config)
    if keys is not None:
        _guard_openai(app, keys)
    _openai_routes(app, service)
    _peer_routes(app, service)
    return app


def _lifespan(service: ReplicaService) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine and the runtime watch start with it and stop with it."""
    host = service.host

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await host.live_engine.start()
        host.watch_runtime()
        logger.info("replica %s ready (%s engine)", service.replica_id, service.engine_kind)
        try:
            yield
        finally:
            await host.stop_watching()
            await host.live_engine.shutdown()

    return lifespan


def _guard_openai(app: FastAPI, keys: ApiKeys) -> None:
    """Ask the OpenAI endpoints for an API key."""

    @app.middleware("http")
    async def api_keys(request: Request, call_next: Any) -> Response:
        # The OpenAI API wants a key (vLLM's --api-key guards /v1 alone): health,
        # metrics, the peers' tokenizer and info endpoints and /engine/* stay open.
        path = request.url.path
        if path.startswith("/v1/") and (refused := await refusal(keys, request)) is not None:
            return refused
        response: Response = await call_next(request)
        return response


def _openai_routes(app: FastAPI, service: ReplicaService) -> None:
    """The OpenAI endpoints: completions, chat completions, the model list."""

    async def openai(request: Request, chat: bool) -> Response:
        deadline = service.limits.deadline()
        try:
            return await service.respond(await service.front.read(request), chat, deadline)
        except APIError as exc:
            return error_response(exc)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai(request, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await openai(request, True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(service.config.model, int(service.started), service.max_model_len)


def _peer_routes(app: FastAPI, service: ReplicaService) -> None:
    """What vLLM's server answers its peers and tools: version, server and model info, the
    tokenizer, the prompt renderers."""

    async def json_body(request: Request) -> Any:
        """A peer's JSON body, within the body limit (the tokenizing endpoints)."""
        return await read_json(request, service.limits.max_body_bytes)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "prefixmesh-replica-server"}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return service.server_info()

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return service.model_info()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        ids = await service.tokens_of(await json_body(request))
        count, limit = len(ids), service.max_model_len
        return {"count": count, "max_model_len": limit, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = await json_body(request)
        return {"prompt": service.tokenizer.decode(body.get("tokens", []))}

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> list[dict[str, Any]]:
        body = await json_body(request)
        prompt = body.get("prompt", "")
        several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        return [
            service.render(body, await service.tokens_of({"prompt": one}), "cmpl")
            for one in (prompt if several else [prompt])
        ]

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        return service.render(body, await service.tokens_of(body), "chatcmpl")


def make_service(config: PrefixmeshConfig, replica_id: str, rank: int = 0) -> ReplicaService:
    """One replica server's service: its engine (``replica.engine``, started by the app) and the
    model's tokenizer (the demo model's unless ``replica.model_path`` names one)."""
    from transformers import AutoTokenizer

    from prefixmesh.replica.demo_model import resolve_model_path
    from prefixmesh.replica.serving.deployment import make_engine

    engine_kind = config.replica.engine
    if engine_kind not in ("sim", "vllm"):
        raise ValueError(f"replica.engine must be sim or vllm, got {engine_kind!r}")
    model_dir = resolve_model_path(config)
    host = EngineHost(config.model, replica_id)
    host.attach(make_engine(config, model_dir, rank, host.sink))
    try:
        vocabulary: Vocabulary | None = Vocabulary.from_tokenizer_dir(model_dir)
    except (OSError, ValueError):  # no tokenizer.json, or no single-token words: no shortcut
        vocabulary = None
    tokenizer = PromptTokenizer(AutoTokenizer.from_pretrained(model_dir), vocabulary)
    return ReplicaService(config, host, tokenizer, engine_kind=engine_kind, model_dir=model_dir)


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    from prefixmesh.cli_help import add_overrides, command_parser

    parser = command_parser(prog, __doc__)
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="the engine")
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address; anything but loopback exposes the replica",
    )
    parser.add_argument("--replica-id", help="name in headers and metrics (default: none, r<port>)")
    parser.add_argument(
        "--rank", type=int, default=0, help="vllm on CPU: bind the engine to core rank mod cores"
    )
    parser.add_argument(
        "--config",
        help="YAML config: model, cache, replica.sim, replica.vllm (default: none, the embedded "
        "defaults)",
    )
    add_overrides(parser, help="override a config field; repeatable")
    parser.add_argument(
        "--log-level",
        default="warning",
        help="uvicorn's and the logs' level: critical, error, warning, info or debug",
    )
    return parser.parse_args(argv)


def server_config(args: argparse.Namespace) -> PrefixmeshConfig:
    """The file and ``--set`` overrides, with ``--engine`` laid over them before validation, so
    an unset ``cache.block_size`` follows the engine the server runs."""
    return load_config(args.config, [*args.overrides, f"replica.engine={args.engine}"])


def main(argv: list[str], prog: str = "replica-server") -> int:
    args = parse_args(argv, prog)
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"{prog}: listening on {args.host}, not loopback", file=sys.stderr)
    config = server_config(args)
    service = make_service(config, args.replica_id or f"r{args.port}", args.rank)
    uvicorn.run(
        build_app(service),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=30,  # longer than the remote engine's idle pool expiry (2 s)
        timeout_graceful_shutdown=5,
    )
    return 0
