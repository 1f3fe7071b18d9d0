"""``ingress``, ``serving``, ``ray``: how requests reach the replicas, and where Ray runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixmesh.config.base import Section


class IngressConfig(Section):
    host: str = "127.0.0.1"
    """Address the HTTP proxy listens on (loopback unless you mean to expose it)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI API."""
    num_replicas: int = Field(default=1, ge=1)
    """Ingress replicas on the proxy path; more than one needs the redis registry backend. (On
    the direct path Ray runs ``serving.routers_per_node`` routers per node instead.)"""
    max_ongoing_requests: int = Field(default=512, ge=1)
    """Concurrent requests per ingress replica."""
    health_check_period_s: float = Field(default=1.0, gt=0)
    """How often Serve checks that each ingress replica (the router on the direct path) lives.
    HAProxy learns a router died only from Serve: until then it still asks the dead one, and with
    no other router to ask it answers 503 (Serve's default period is 10 s)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Upper bound on one request, streaming included."""
    retries: int = Field(default=1, ge=0)
    """Times a request is sent again, to another replica, after its replica died (or its
    remote engine broke off): before the first token always, mid-generation only when not
    streaming (nothing has reached the client yet). Application errors are never retried."""


class ServingConfig(Section):
    """How requests reach the replicas."""

    path: Literal["direct", "proxy"] = "direct"
    """``direct``: Ray Serve's HAProxy ingress asks our router deployment (``/internal/route``)
    which replica takes each POST, then forwards it there; the replica serves the OpenAI API and
    streams straight back. ``proxy``: the ingress deployment (FastAPI behind Ray's proxy, or
    behind HAProxy when it runs) calls the replicas through a Serve handle with our request
    router. Both need Ray's HAProxy mode for ``direct`` (``prefixmesh serve`` turns it on)."""
    router_timeout_s: int = Field(default=5, ge=1)
    """HAProxy's limit on one routing call (``RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S``):
    past it the client gets a 503, so the router answers within ``route_budget_share`` of it
    whatever the registry does."""
    route_budget_share: float = Field(default=0.5, gt=0, lt=1)
    """Share of ``router_timeout_s`` a routing call may take before it answers with a
    load-balanced choice."""
    proxy_ready_timeout_s: float = Field(default=30.0, gt=0)
    """How long Serve waits for a node's proxy (HAProxy and its manager actor) to start before
    it kills and restarts it (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``). Ray's 5 s is too short
    on a loaded machine: ``serve.start`` then fails on the proxy it killed."""
    replica_drain_s: float = Field(default=30.0, ge=0)
    """How long a stopping replica keeps serving behind HAProxy before it refuses connections
    (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, Ray's 30 s): the time for every
    HAProxy to drop it from its pool. Deleting or redeploying the app waits this long."""
    routers_per_node: int = Field(default=1, ge=1)
    """Router replicas beside each HAProxy (``RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE``: Ray
    pins the router deployment to the proxy nodes and ignores its ``num_replicas``). HAProxy
    asks its node's routers in turn, and the next one when a router refuses the connection or
    drops it unanswered: with two, a killed router costs at most the requests in flight to it;
    with one, HAProxy answers 503 until Serve notices (``ingress.health_check_period_s``), then
    balances over the replicas until a new router runs. More than one needs the redis
    registry."""
    max_body_bytes: int = Field(default=2**20, ge=65536)
    """Largest request body HAProxy buffers for the router; a longer body is refused with 413
    rather than routed on a truncated prompt. It sets HAProxy's ``tune.bufsize``, the size of
    every buffer it allocates, and retries need one per request: 8 MiB (Ray's default) cost
    about 5 ms per request here, 1 MiB under 1 ms (docs/benchmarks-log.md). 1 MiB is about 250K
    tokens of text."""
    retry_on: str = "conn-failure empty-response 503"
    """HAProxy's ``retry-on``: a replica that dies before answering (it sends nothing before
    the first token) or answers 503 (its engine failed before the first token) has the request
    sent to another replica (``option redispatch``)."""
    retries: int = Field(default=5, ge=1)
    """HAProxy's ``retries`` per request: a killed replica stays "up" until its health checks
    fail, so a redispatch may try it again (it is marked down after 3 refused connections)."""
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    """Where Serve runs its ingress (HAProxy and the routers beside it on the direct path):
    ``EveryNode`` (Serve's default; put a load balancer in front), or ``HeadOnly`` (one front
    door on the head; worker nodes run replicas only)."""
    haproxy_stats_port: int = Field(default=0, ge=0, le=65535)
    """HAProxy's stats page port; Ray binds it on all interfaces (0: a free port)."""
    haproxy_metrics_port: int = Field(default=0, ge=0, le=65535)
    """HAProxy's Prometheus exporter port; Ray binds it on all interfaces (0: a free port)."""


class RayConfig(Section):
    address: str | None = None
    """Join this Ray cluster; None starts a local one on 127.0.0.1."""
    num_cpus: int | None = None
    """CPUs of a locally started Ray (None: all)."""
    temp_dir: str | None = None
    """Ray's temp/log folder for a local start (None: Ray's default)."""
    session_niceness: int = Field(default=10, ge=0, le=19)
    """A local start's niceness against the machine's other sessions (Linux's autogroup: the
    scheduler shares the CPU between sessions before it looks at a process's own niceness):
    with the engines decoding on every core, a client in another terminal still gets the CPU
    at once (``local_ray.yield_to_other_sessions``). 0: leave it."""
