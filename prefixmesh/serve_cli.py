"""``prefixmesh serve``: start Ray on 127.0.0.1 (or join --address), deploy, print the URL,
and shut everything down on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from typing import Any

import psutil

from prefixmesh.cli_help import add_overrides, command_parser
from prefixmesh.config import PrefixmeshConfig, load_config
from prefixmesh.deploy_progress import run_with_progress
from prefixmesh.local_ray import (
    configure_environment,
    haproxy_enabled,
    init_local_ray,
    restore_session,
    yield_to_other_sessions,
)
from prefixmesh.reaper import Reaper


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--config", help="YAML config file (default: none, the embedded defaults alone)"
    )
    parser.add_argument(
        "--address",
        help="join the Ray cluster at this address, as ray.init takes it, e.g. auto (default: "
        "none, start a local Ray on 127.0.0.1)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="with --address: deploy and exit, leaving the app running on that cluster",
    )
    add_overrides(parser)
    return parser.parse_args(argv)


def main(argv: list[str], prog: str = "serve") -> int:
    args = parse_args(argv, prog)
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"ray.address={args.address}")
    config = load_config(args.config, overrides)
    if args.detach and not config.ray.address:
        print(f"{prog}: --detach needs a cluster to leave the app on (--address)", file=sys.stderr)
        return 2
    warning = registry_warning(config)
    if warning:
        print(f"{prog}: WARNING: {warning}", file=sys.stderr, flush=True)
    # Ray listens and dials on 127.0.0.1 only when every process has this (docs/design.md §7), and
    # Serve reads its HAProxy settings at import: set before Ray is imported, inherited by
    # everything it starts.
    haproxy_dir = configure_environment(None if config.ray.address else config.serving)
    reaper = Reaper.start()  # killed, this process would leave HAProxy holding the port
    if haproxy_dir is not None and not args.detach:
        reaper.watch_haproxy(haproxy_dir)

    from ray import serve

    from prefixmesh.app import build_app

    niceness_before = None
    if not config.ray.address and config.ray.session_niceness:
        # The whole session: Ray's processes are its children (put back at the end).
        niceness_before = yield_to_other_sessions(config.ray.session_niceness)
        if niceness_before is not None:  # killed, serve could not put it back itself
            reaper.restore_session(niceness_before)
    try:
        agent_port = start_ray(config, prog, reaper)
        if agent_port:  # the replicas' /metrics read the agent (replica/serving/node_metrics.py)
            metrics = config.metrics.model_copy(update={"export_port": agent_port})
            config = config.model_copy(update={"metrics": metrics})
        serve.start(
            http_options={"host": config.ingress.host, "port": config.ingress.port},
            proxy_location=config.serving.proxy_location,
        )
        print(
            f"deploying {config.replica.num_replicas} {config.replica.engine} replicas ...",
            flush=True,
        )
        app = build_app(config)
        name = config.app_name

        def deployments() -> Any:
            application = serve.status().applications.get(name)
            return application.deployments if application is not None else {}

        run_with_progress(
            lambda: serve.run(app, name=name, route_prefix="/"),
            deployments,
            lambda line: print(line, flush=True),
        )
        url = f"http://{config.ingress.host}:{config.ingress.port}"
        if args.detach:  # the app stays on the cluster; `serve shutdown` removes it
            print(f"prefixmesh is serving {config.model!r} at {url}/v1", flush=True)
            return 0
        print(f"prefixmesh is serving {config.model!r} at {url}/v1 (Ctrl-C stops it)", flush=True)
        if agent_port:
            print(
                f"metrics of every replica and router, labelled: {scrape_url(agent_port)} "
                "(also at the front door's /metrics; Prometheus: "
                "manifests/prometheus/prometheus.yml)",
                flush=True,
            )
        _wait_for_stop()
        print("shutting down ...", flush=True)
        # A local Ray goes away whole with ray.shutdown: Serve's own shutdown would only wait
        # for its controller (30 s, then a warning); the engines' reapers stop the engines.
        # Its replicas' goodbyes to a Redis registry (dropping their entries) need it.
        if config.ray.address or config.registry.backend != "memory":
            serve.shutdown()  # type: ignore[no-untyped-call]  # Ray Serve leaves it unannotated
    finally:
        stop_ray(reaper)
        restore_session(niceness_before)
    return 0


def stop_ray(reaper: Reaper) -> None:
    """Shut Ray down, wait for its processes (its workers notice the raylet is gone a moment
    later; until then its HAProxy manager may still write into HAProxy's folder), then let
    the reaper stop HAProxy and remove its folder."""
    import ray

    started = ray_processes(reaper.pid)
    ray.shutdown()
    psutil.wait_procs(started, timeout=STOP_WAIT_S)
    reaper.close()


def start_ray(config: PrefixmeshConfig, prog: str, reaper: Reaper) -> int | None:
    """Join ``ray.address``, or start a local Ray (its processes in ``reaper``'s care); the
    port of the local node's metrics agent (None for a joined cluster: its operator knows)."""
    import ray

    if config.ray.address:
        if config.serving.path == "direct" and not haproxy_enabled():
            print(
                f"{prog}: serving.path=direct needs Ray Serve's HAProxy mode on that cluster "
                "(RAY_SERVE_ENABLE_HA_PROXY=1 and the settings of prefixmesh.local_ray."
                "haproxy_environment in its nodes' environment)",
                file=sys.stderr,
            )
        ray.init(address=config.ray.address, log_to_driver=False)
        return None
    context = init_local_ray(
        config.ray.temp_dir, config.ray.num_cpus, config.serving, config.metrics
    )
    # Killed, this process takes Ray's raylet and GCS along, not the node's agents.
    reaper.watch(p.pid for p in ray_processes(reaper.pid))
    port = context.address_info.get("metrics_export_port")
    return int(port) if port else None


STOP_WAIT_S = 10.0
"""How long a stop waits for Ray's processes to end before removing their files."""


def ray_processes(reaper_pid: int) -> list[psutil.Process]:
    """Everything this process started (Ray's processes and their workers), but the reaper."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid != reaper_pid]


def scrape_url(agent_port: int) -> str:
    """Ray's metrics agent on this node, where a scraper finds the whole cluster's series."""
    return f"http://127.0.0.1:{agent_port}/metrics"


def registry_warning(config: PrefixmeshConfig) -> str | None:
    """What is wrong with the configured registry, checked once before deploying (within four
    op timeouts, as a registry client's connect), or None: serving starts anyway, routing on
    load alone until the registry answers (``/health`` says ``degraded`` meanwhile)."""
    if config.registry.backend == "memory":
        return None
    from prefixmesh.cache_registry.factory import make_registry_probe

    async def check() -> str | None:
        probe = make_registry_probe(config, timeout_s=config.registry.op_timeout_ms * 4 / 1000)
        try:
            verdict = await probe.check()
        finally:
            await probe.close()
        if verdict.ok:
            return None
        return (
            f"the registry is degraded ({verdict.reason}): {verdict.message}. prefixmesh serves "
            "anyway, routing on load alone, until the registry answers"
        )

    return asyncio.run(check())


def _wait_for_stop() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
