"""A router replica killed under load on the direct path (issue 14: it costs at most the requests
in flight to it, and Serve replaces it).

HAProxy asks a router (``POST /internal/route``) where each POST goes, through a Lua action Ray
writes: it takes its node's routers in turn, asks the next one when a router refuses the
connection or closes it unanswered, and answers 503 (``X-Serve-Reason``) when none answers. It
learns that a router died only from Serve (the controller's health check,
``ingress.health_check_period_s``) and then drops it; while no router runs it balances the
requests over the replicas itself (no cache affinity, no failure). Serve runs
``serving.routers_per_node`` routers beside each HAProxy.

So with two routers (the Redis registry) a killed one costs at most what was in flight to it:
asserted here, on a cluster of its own (``prefixmesh serve`` in a child process: the routers per
node are a Ray setting read when Serve starts, and the session's cluster runs one). With one
router (the in-process registry lives in it) every request that reaches HAProxy before Serve
notices gets its 503: measured on the session's cluster, and asserted to stop once HAProxy has
dropped the dead router, within a few health-check periods.

Each test drives test_faults' load (4 requests/s, half streamed, 2 sim replicas slowed down 5x)
through HAProxy, SIGKILLs a router replica's process, waits until HAProxy asks a router in a new
process (Serve gives it only running replicas), checks that the new router routes, and writes a
JSON summary (sent, succeeded, failed, unanswered at the kill, seconds until HAProxy dropped the
dead router and until it asked a new one) to $FAULTS_REPORT_DIR when set.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from prefixmesh.config import load_config
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.local_ray import haproxy_environment, haproxy_router_pool, stop_haproxy
from prefixmesh.ports import free_port
from tests.conftest import TEST_REPLICA_DRAIN_S
from tests.e2e.conftest import Cluster, Deploy
from tests.e2e.test_faults import DOCUMENTS, MODEL, LoadRun, Outcome, metric, write_report

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]
SIM = (
    "replica.engine=sim",
    "replica.num_replicas=2",
    "replica.max_ongoing_requests=64",
    "replica.sim.time_scale=5",
    "replica.routing_stats_period_s=0.5",
)
KILL_AT_S, DURATION_S = 4.0, 20.0
RECOVER_WITHIN_S = 60.0
"""A new router replica starts a Python process and loads the tokenizer: seconds, on 2 cores
shared with the replicas and the load."""


@dataclass(frozen=True)
class Front:
    base_url: str
    haproxy_config: str | None = None
    """HAProxy's ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC``; None: this process's cluster's."""


@pytest.fixture(scope="module")
def two_routers() -> Iterator[Front]:
    """``prefixmesh serve`` in a child process: a Ray of its own, two routers beside HAProxy,
    the Redis registry, the same sim replicas."""
    redis = LocalRedisServer()
    redis.start()
    run_dir = Path(tempfile.mkdtemp(prefix="pmh-", dir="/tmp"))
    temp_dir = tempfile.mkdtemp(prefix="pmray-", dir="/tmp")
    port = free_port()
    overrides = [
        *SIM,
        "registry.backend=redis",
        f"registry.redis_url={redis.url}",
        "serving.routers_per_node=2",
        f"serving.replica_drain_s={TEST_REPLICA_DRAIN_S}",
        f"ingress.port={port}",
        f"ray.temp_dir={temp_dir}",
        "ray.num_cpus=2",
        f"cache_dir={Path('~/.cache/prefixmesh').expanduser()}",
    ]
    serving = load_config(overrides=overrides).serving
    # Not this process's Ray, nor its HAProxy: ours, configured as `prefixmesh serve` would.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_", "RAY_ADDRESS"))}
    env |= haproxy_environment(serving, run_dir)
    log = run_dir / "serve.log"
    command = [sys.executable, "-m", "prefixmesh.cli", "serve"]
    command += [arg for override in overrides for arg in ("--set", override)]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "prefixmesh is serving" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield Front(f"http://127.0.0.1:{port}", str(run_dir / "haproxy.cfg"))
    finally:
        process.send_signal(signal.SIGTERM)  # serve shutdown, then Ray's
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stop_haproxy(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
        redis.close()


# ---- routers, as HAProxy sees them -------------------------------------------------------------


def pool_ports(front: Front) -> set[int]:
    """The ports of the routers HAProxy asks (two equal reads: Ray rewrites its files in place)."""
    while True:
        first = {port for _, port in haproxy_router_pool(front.haproxy_config)}
        time.sleep(0.05)
        if {port for _, port in haproxy_router_pool(front.haproxy_config)} == first:
            return first


def listening_pid(port: int) -> int | None:
    """The process listening on ``port`` on this machine."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return connection.pid
    return None


def process_title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def decisions(port: int) -> float:
    """Routing decisions the router on ``port`` made (its own metrics, from its own port)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return metric(text, "prefixmesh_routing_decision_seconds_count")


def complete(front: Front, n: int, question: str) -> httpx.Response:
    response = httpx.post(
        f"{front.base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": DOCUMENTS[n % len(DOCUMENTS)] + question, "max_tokens": 2},
    )
    assert response.status_code == 200, response.text
    return response


def settle(front: Front, routers: int, timeout_s: float = 120) -> dict[int, int]:
    """Wait until HAProxy asks ``routers`` routers, each listening in its process, and every
    document has been served once; returns each router's port -> process."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = {port: listening_pid(port) for port in pool_ports(front)}
        found = {port: pid for port, pid in pids.items() if pid}
        if len(pids) == len(found) == routers:
            for n in range(len(DOCUMENTS)):
                complete(front, n, " Warm up?")
            return found
        assert time.monotonic() < deadline, pids
        time.sleep(0.5)


# ---- the fault --------------------------------------------------------------------------------


@dataclass
class RouterKill:
    port: int
    pid: int
    at_s: float = 0.0
    """On the load's clock."""
    dropped_s: float | None = None
    """Since the kill: HAProxy no longer asks the killed router."""
    rejoined_s: float | None = None
    """Since the kill: HAProxy asks a router in a new process (Serve runs it)."""
    newcomer_port: int = 0
    newcomer_pid: int = 0


async def watch_recovery(front: Front, kill: RouterKill, old: set[int], routers: int) -> None:
    """Note when HAProxy drops the killed router and when it asks a new one, as many as before."""
    started = time.monotonic()
    while time.monotonic() - started < RECOVER_WITHIN_S:
        pool = await asyncio.to_thread(pool_ports, front)
        pids = {port: await asyncio.to_thread(listening_pid, port) for port in pool}
        elapsed = time.monotonic() - started
        moved = kill.port in pool and pids[kill.port] not in (None, kill.pid)  # port reused
        if kill.dropped_s is None and (kill.port not in pool or moved):
            kill.dropped_s = elapsed
        new = [(port, pid) for port, pid in pids.items() if pid and pid not in old]
        if new and len(pool) == routers:
            kill.rejoined_s = elapsed
            kill.newcomer_port, kill.newcomer_pid = new[0]
            return
        await asyncio.sleep(0.1)


def kill_a_router_under_load(front: Front, routers: int) -> tuple[LoadRun, RouterKill, float]:
    """Kill one of ``routers`` router replicas (SIGKILL to its process) 4 s into 20 s of load;
    returns the load, the kill, and the decisions the new router made for 16 more requests."""
    before = settle(front, routers)
    victim = min(before)
    kill = RouterKill(victim, before[victim])

    async def fault(run: LoadRun) -> None:
        await asyncio.sleep(KILL_AT_S)
        os.kill(kill.pid, signal.SIGKILL)
        kill.at_s = run.now()
        await watch_recovery(front, kill, set(before.values()), routers)

    run = LoadRun(front.base_url)
    asyncio.run(run.run(DURATION_S, fault))
    assert kill.rejoined_s is not None, kill  # Serve ran a new router and HAProxy asks it
    routed_before = decisions(kill.newcomer_port)
    for n in range(16):
        complete(front, n, " After the recovery?")
    return run, kill, decisions(kill.newcomer_port) - routed_before


def unanswered_at(run: LoadRun, at_s: float) -> list[Outcome]:
    """Requests sent by ``at_s`` whose response had not begun by then: those in flight at the
    router then, and those still before their first byte at a replica (an upper bound)."""
    return [o for o in run.outcomes if o.sent_s <= at_s and not 0 < o.answered_s <= at_s]


def summarize(
    run: LoadRun, kill: RouterKill, routers: int, period_s: float, newcomer_routed: float
) -> dict[str, Any]:
    failed = run.failed()
    after_kill = [o for o in run.outcomes if o.sent_s > kill.at_s]
    return run.summary(
        fault=f"one of {routers} router replicas killed (SIGKILL to its process)",
        routers=routers,
        health_check_period_s=period_s,
        unanswered_at_kill=len(unanswered_at(run, kill.at_s)),
        failed_reasons=dict(Counter(o.reason or o.error[:60] for o in failed)),
        failed_sent_after_kill=sum(o.sent_s > kill.at_s for o in failed),
        sent_after_kill=len(after_kill),
        succeeded_after_kill=sum(o.ok for o in after_kill),
        dropped_from_haproxy_s=kill.dropped_s,
        new_router_in_haproxy_s=kill.rejoined_s,
        new_router_process=process_title(kill.newcomer_pid)[:80],
        new_router_decisions_of_16=newcomer_routed,
    )


@pytest.mark.timeout(600)  # the child cluster starts in a few minutes on 2 busy cores
def test_one_of_two_routers_killed_costs_at_most_its_requests_in_flight(
    two_routers: Front,
) -> None:
    """Two routers share the Redis registry: HAProxy asks the other router for every request the
    killed one refused or dropped, so nothing sent after the kill fails, and what fails at all
    was in flight at the kill; Serve runs a new router, HAProxy asks it, and it routes."""
    run, kill, newcomer_routed = kill_a_router_under_load(two_routers, 2)
    period_s = load_config().ingress.health_check_period_s
    summary = summarize(run, kill, 2, period_s, newcomer_routed)
    write_report("router_killed_of_two", summary)
    failed = run.failed()
    assert len(failed) <= summary["unanswered_at_kill"], summary
    # Only HAProxy's own refusals (nothing a replica accepted), of requests sent before the kill.
    assert all(o.reason and o.sent_s <= kill.at_s for o in failed), failed[:5]
    assert summary["succeeded_after_kill"] == summary["sent_after_kill"], summary
    assert summary["stream_error_events"] == summary["streams_cut"] == 0, summary
    assert "Router" in summary["new_router_process"], summary
    assert newcomer_routed > 0, summary


def test_the_only_router_killed_fails_requests_until_serve_notices(
    ray_cluster: Cluster, deploy: Deploy
) -> None:
    """One router (the in-process registry lives in it): HAProxy answers 503 to the requests in
    flight to it and to those that arrive before Serve's health check notices it died, then
    balances over the replicas until a new router runs, and asks that one. Every failure is a
    503 of HAProxy's own (no request a replica accepted is lost), the failures end once HAProxy
    drops the router, and that takes a few health-check periods (Serve's default, 10 s, is
    what ``ingress.health_check_period_s`` shortens)."""
    config = deploy(*SIM)
    front = Front(ray_cluster.base_url)
    run, kill, newcomer_routed = kill_a_router_under_load(front, 1)
    period_s = config.ingress.health_check_period_s
    summary = summarize(run, kill, 1, period_s, newcomer_routed)
    write_report("router_killed_only_one", summary)
    failed = run.failed()
    assert all(o.reason.startswith("router_") for o in failed), failed[:5]
    assert summary["stream_error_events"] == summary["streams_cut"] == 0, summary
    # The failures are one stretch from the kill: once a request sent after it succeeds (HAProxy
    # dropped the dead router), every later one does.
    after_kill = sorted((o for o in run.outcomes if o.sent_s > kill.at_s), key=lambda o: o.n)
    first_ok = next((i for i, o in enumerate(after_kill) if o.ok), len(after_kill))
    assert first_ok < len(after_kill), summary
    assert all(o.ok for o in after_kill[first_ok:]), summary
    assert kill.dropped_s is not None and kill.dropped_s <= 4 * period_s + 2, summary
    assert "Router" in summary["new_router_process"], summary
    assert newcomer_routed > 0, summary
