"""The direct path's router: Ray Serve's HAProxy asks it where each POST goes.

HAProxy's Lua action forwards the client's body to ``POST /internal/route`` and pins the request
to the replica named in the answer, setting the answer's ``request_headers`` on it as trusted
headers (``wire/route_ticket.py``). Here the front door (``api/prepare.py``) validates,
templates, tokenizes and hashes the body, and the replica handle's request router (ours,
``serve_router.py``: registry lookup, policy, claims, speculative entries) picks the replica
without dispatching anything (``serve_private.pick_replica``) and leaves its ``RouteTicket`` in
the state this process shares with it (``LocalRouterState.take_ticket``); the ticket, with the
replica Serve picked, becomes the trusted headers. The replica serves and streams the response
itself.
A claim the decision took stays here: this router's ledger releases it when a replica's report
lists the request (``router/core/holds.py``).

Tracing: HAProxy forwards the client's ``traceparent`` here under Serve's session header
(``local_ray.haproxy_environment`` names it so); the call's span continues it, the decision's
span is its child, and the decision's context rides in the ticket to the replica, whose spans
are the decision's children (``router/core/spans.py``).

HAProxy answers the client 503 when a routing call errs or outlasts
``serving.router_timeout_s``, so this never errs and answers within ``route_budget_share`` of
it: an invalid body (the replica re-validates it and answers the OpenAI error), a body longer
than HAProxy forwards, a slow registry or a failing policy all get a load-balanced pick.

Limits come before work here too (``api/limits.py``): a truncated body is not read, one over
``limits.max_body_bytes`` is not read past the limit, and a prompt that cannot fit the context
(or a ``max_tokens`` over the cap) is not tokenized; each gets a load-balanced pick, and the
replica refuses it as cheaply with the OpenAI error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from prefixmesh import tracing
from prefixmesh.api.errors import APIError, install_error_handlers
from prefixmesh.api.limits import BodySource, RequestLimits
from prefixmesh.api.prepare import FrontDoor, is_chat, new_request_id
from prefixmesh.api.prompts import PromptEncoder
from prefixmesh.cache_registry.factory import (
    make_hasher,
    make_memory_state,
    make_registry_probe,
)
from prefixmesh.cache_registry.types import CacheEvent, PublishResult, ReplicaId
from prefixmesh.config import PrefixmeshConfig
from prefixmesh.router.core.local_state import local_state
from prefixmesh.router.core.spans import NO_ROUTER_TRACE, NoRouterTrace, router_trace
from prefixmesh.router.front.registry_watch import RegistryWatch
from prefixmesh.serve_private import init_handle, pick_replica
from prefixmesh.wire import GenerateRequest, LoadBalanced
from prefixmesh.wire.request_progress import RequestProgress
from prefixmesh.wire.route_ticket import RouteTicket, key_digest

logger = logging.getLogger(__name__)
api = install_error_handlers(
    FastAPI(title="prefixmesh router", docs_url=None, redoc_url=None, redirect_slashes=False)
)
FALLBACK_REASON = "fallback"
"""A ticket's reason when the router balanced a request whose decision it cut short."""
TRUNCATED_HEADER = "x-body-truncated"
"""HAProxy's mark on a body longer than it buffers for the router."""


@serve.ingress(api)
class RouterServer:
    def __init__(self, replicas: Any, config_json: str, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.config = PrefixmeshConfig.model_validate_json(config_json)
        config = self.config
        tracing.setup(config.telemetry, "router")  # the request router shares this process
        self._replicas = replicas
        init_handle(replicas)  # build the handle's request router now, not at the first POST
        encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_path))
        limits = RequestLimits.from_config(config, encoder.hf)
        self._front = FrontDoor(config.model, limits, encoder, make_hasher(config))
        self._local = local_state(config.app_name, lambda: make_memory_state(config))
        self._registry_watch = RegistryWatch(make_registry_probe(config), self._local.metrics)
        serving = config.serving
        self._budget_s = serving.router_timeout_s * serving.route_budget_share
        self._unseen_expiry_s = config.ingress.request_timeout_s
        self.routed = 0
        self.fallbacks = 0

    @api.post("/internal/route")
    async def route(self, request: Request) -> Response:
        arrived_ns = time.time_ns()
        truncated = TRUNCATED_HEADER in request.headers
        trace = router_trace(request.headers, arrived_ns, truncated)  # no-op when tracing is off
        generate: GenerateRequest | None = None
        try:
            async with asyncio.timeout(self._budget_s):
                if not truncated:  # a truncated body would key a wrong prefix: balance it
                    generate = await self._prepare(request, trace.carrier)
                return await self._choose(generate, arrived_ns, trace)
        except Exception as exc:  # the deadline, or anything else: never HAProxy's 503
            if not isinstance(exc, TimeoutError):
                logger.exception("routing failed; answering with a load-balanced pick")
            reason = "timeout" if isinstance(exc, TimeoutError) else "error"
            self._local.metrics.fell_back(reason)
            trace.fell_back(reason, exc)
            async with asyncio.timeout(self._budget_s):
                return await self._choose(None, arrived_ns, trace, abandoned=generate, why=reason)
        finally:
            trace.end()

    async def _prepare(
        self, request: BodySource, trace_context: dict[str, str] | None = None
    ) -> GenerateRequest | None:
        """The request as the replicas' router sees it; None for input the replica will refuse
        (it answers the OpenAI error itself), found before the work it would waste."""
        try:
            raw = await self._front.read(request)
            chat = is_chat(raw)
            prepared = await self._front.prepare(raw, chat)
        except APIError:
            return None
        return prepared.engine_request(new_request_id(chat), trace_context=trace_context)

    async def _choose(
        self,
        generate: GenerateRequest | None,
        arrived_ns: int,
        trace: NoRouterTrace = NO_ROUTER_TRACE,
        *,
        abandoned: GenerateRequest | None = None,
        why: str = "",
    ) -> Response:
        """The replica for ``generate`` (None: a load-balanced pick). ``abandoned``: a request
        whose decision was cut short by ``why`` (the deadline, an error) and is balanced now."""
        target: Any = generate if generate is not None else LoadBalanced()
        picked = await pick_replica(self._replicas, target)
        full_id, unique_id = picked.full_id, picked.unique_id
        trace.chose(unique_id, generate)
        if generate is None:
            self.fallbacks += 1
            if abandoned is None:
                return JSONResponse({"replica_id": full_id})
            # The cut-short decision may be in the ledger already: the request keeps its id,
            # so the replica that serves it ends that entry (else it counted for 600 s), and
            # the entry (with any claim) leaves the replica that will not compute it.
            with self._local.lock:
                self._local.ledger.moved(abandoned.request_id, ReplicaId(unique_id))
                late = self._local.take_ticket(abandoned.request_id)  # decided, then cut short
            ticket = RouteTicket(
                request_id=abandoned.request_id,
                replica_id=unique_id,
                reason=f"{FALLBACK_REASON}_{why}",
                matched_blocks=0,
                key_digest=key_digest(abandoned.key),
                arrived_ns=arrived_ns,
                trace_context=late.trace_context if late else abandoned.trace_context,
            )
            return JSONResponse({"replica_id": full_id, "request_headers": ticket.headers()})
        self.routed += 1
        with self._local.lock:
            decided = self._local.take_ticket(generate.request_id)
        if decided is None:  # the request router fell back without a decision
            decided = RouteTicket(
                generate.request_id, unique_id, "", trace_context=generate.trace_context
            )
        ticket = dataclasses.replace(
            decided,
            replica_id=unique_id,
            key_digest=key_digest(generate.key),
            arrived_ns=arrived_ns,
            # A hold binds to the replica it was decided for (Serve may take a lower rank).
            hold=decided.hold if decided.replica_id == unique_id else None,
        )
        return JSONResponse({"replica_id": full_id, "request_headers": ticket.headers()})

    # ---- operators and tests (through the deployment handle: HAProxy sends GETs to the
    # replicas) ---------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        """``{"status": "ok"}`` or ``degraded`` with the registry's problem (``RegistryWatch``)."""
        return await self._registry_watch.health()

    async def check_health(self) -> None:
        """Serve's periodic check (``ingress.health_check_period_s``): refreshes the registry's
        health and never fails for it."""
        await self._registry_watch.refresh()

    async def router_metrics(self) -> str:
        """The router's Prometheus exposition (decisions, lookups, holds, load it saw)."""
        return self._local.metrics_now().render()

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return PlainTextResponse(await self.router_metrics(), media_type="text/plain")

    async def counts(self) -> dict[str, int]:
        """Requests routed (by decision, and load-balanced blind) and those still on their way
        to a replica (the ledger, after the replicas' latest reports)."""
        stats = self._local.replica_stats()
        reports = [(str(s["replica_id"]), s) for s in stats]
        with self._local.lock:
            self._local.apply_reports(
                reports,
                time.monotonic(),
                self._unseen_expiry_s,
                progress_pushed=self.config.progress_to_router,
            )
            in_flight = len(self._local.ledger)
        return {"routed": self.routed, "fallbacks": self.fallbacks, "in_flight": in_flight}

    async def request_progress(self, progress: RequestProgress) -> None:
        """Replicas' first tokens and ends (``PrefixmeshConfig.progress_to_router``)."""
        with self._local.lock:
            self._local.apply_progress(progress)

    async def ingest_cache_events(self, events: list[CacheEvent]) -> list[PublishResult]:
        """In-process registry mode: replicas send their cache events here."""
        return self._local.publish(events)

    async def registry_replicas(self) -> dict[str, Any]:
        if self.config.registry.backend != "memory":
            return {"backend": self.config.registry.backend, "replicas": None}
        return {"backend": "memory", "replicas": self._local.registry_replicas()}

    async def replica_endpoints(self) -> list[tuple[str, int]]:
        """Each replica's own HTTP address (benchmarks compare the full path with it)."""
        source = self._local.stats_source
        replicas = list(source.curr_replicas.values()) if source is not None else []
        endpoints = [r.backend_http_endpoint for r in replicas]
        return sorted((str(e[0]), int(e[1])) for e in endpoints if e is not None)

    async def replica_stats(self) -> list[dict[str, Any]]:
        return self._local.replica_stats()

    async def traces(self) -> list[dict[str, Any]]:
        return tracing.finished_spans()
