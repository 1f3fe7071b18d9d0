"""The direct path's replica deployment: the OpenAI API served by the replica itself, behind
HAProxy (``serving.path: direct``). Its routes call the replica's ``DirectFront``
(``direct_front.py``), which holds the request handling; this module binds it to Serve.

GETs (models, health, metrics) reach any replica: HAProxy balances them by connections.
Every error is OpenAI JSON (``api/errors.py``), 404 and 405 included.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

from prefixmesh.api.errors import install_error_handlers
from prefixmesh.replica.serving.deployment import ReplicaServer
from prefixmesh.replica.serving.direct_front import DirectFront

api = install_error_handlers(
    FastAPI(title="prefixmesh replica", docs_url=None, redoc_url=None, redirect_slashes=False)
)


@serve.ingress(api)
class ReplicaHTTPServer(ReplicaServer):
    # Serve awaits an async constructor (mypy wants ``__init__`` to return None).
    async def __init__(self, config_json: str, model_path: str, router_name: str) -> None:  # type: ignore[misc]
        await super().__init__(config_json, model_path, router_name)
        self.http = DirectFront.from_config(self.config, model_path, self)

    async def shutdown(self) -> None:
        await super().shutdown()
        await self.http.close()

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        """What ``GET /health`` through HAProxy gets (any replica answers)."""
        return self.http.health()

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        return await self.http.models(request)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return await self.http.metrics_text()

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.http.serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.http.serve(request, chat=True)
