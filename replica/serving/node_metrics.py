"""The front door's ``/metrics``: the node's whole view, not one replica's.

HAProxy hands a GET to whichever replica it picks, so a replica that answered ``/metrics``
with its own registry gave consecutive scrapes of the front door different processes'
numbers (15, 10, 15, 10: issue 38). Ray's metrics agent on the replica's node has every
serving process's series there, labelled by Serve replica (``ReplicaId``): a replica that
knows the agent's port answers with the agent's text, so every scrape reads the same view,
about 10 s behind (the agent's export interval). Without the port, or while the agent does
not answer, it is the replica's own registry, as before.
"""

from __future__ import annotations

import logging
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)
AGENT_TIMEOUT_S = 5.0


class MetricsSource(Protocol):
    """Where the node's metrics text comes from."""

    async def text(self) -> str: ...


class RayAgentMetrics:
    """Ray's metrics agent of this node, on 127.0.0.1."""

    def __init__(self, port: int, timeout_s: float = AGENT_TIMEOUT_S) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self._timeout_s = timeout_s

    async def text(self) -> str:
        async with httpx.AsyncClient(timeout=self._timeout_s) as client:
            response = await client.get(self.url)
            response.raise_for_status()
            return response.text


def node_metrics(export_port: int) -> MetricsSource | None:
    """The node's agent when its port is known (``metrics.export_port``; ``prefixmesh
    serve`` sets it once the agent runs), else None: the replica's own registry."""
    return RayAgentMetrics(export_port) if export_port else None


async def node_or_own(source: MetricsSource | None, own: str) -> str:
    """The node's metrics text, or ``own`` (the replica's) without a source or when it fails."""
    if source is None:
        return own
    try:
        return await source.text()
    except Exception as exc:  # the agent restarting, or not up yet: the replica's own
        logger.warning("node metrics unavailable, answering this replica's: %s", exc)
        return own
