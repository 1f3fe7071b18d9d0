"""Past one machine (issue 15): a head and two worker nodes, each its own raylet (``ray start``
with its own ports, each on its own loopback address: 127.0.0.2, .3, .4), as `ray up` would
start them.

The head runs Serve's front door (``serving.proxy_location=HeadOnly``: HAProxy and the router);
the replicas need a custom resource only the workers offer (``replica.resources``), so Serve
places them there, spread one per worker. Redis is the registry, reached the way a real
cluster reaches it: every process gets its URL and password from ``PREFIXMESH_REDIS_URL`` and
``PREFIXMESH_REDIS_PASSWORD`` (set in each node's environment, as the cluster YAMLs'
``node-env.sh`` does), and the app is deployed by ``prefixmesh serve --address ... --detach``.

It answers the official openai client; then one worker node is killed (every process of it,
SIGKILL) under test_faults' load (4 requests/s, half streamed): no accepted request is lost
(only streams already past their first token on the dead node may be cut), the dead replica
leaves the registry within the liveness bound, and Serve brings a replacement up on the
surviving worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from prefixmesh.api.render import UNROUTED
from prefixmesh.cache_registry.factory import make_registry
from prefixmesh.cache_registry.types import ReplicaId
from prefixmesh.config import load_config
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.local_ray import haproxy_environment, stop_haproxy
from prefixmesh.ports import free_port
from tests.conftest import TEST_REPLICA_DRAIN_S
from tests.e2e.test_faults import MODEL, LoadRun, wait_until, write_report

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]
WORKER_RESOURCE = "prefixmesh_worker"
APP_SETTINGS = (
    "replica.engine=sim",
    "replica.num_replicas=2",
    "replica.max_ongoing_requests=64",
    "replica.sim.time_scale=5",
    "replica.routing_stats_period_s=0.5",
    f"replica.resources={{{WORKER_RESOURCE}: 1}}",
    "registry.backend=redis",
    "serving.proxy_location=HeadOnly",
    f"serving.replica_drain_s={TEST_REPLICA_DRAIN_S}",
    # HAProxy on the head reaches each replica's own HTTP server at its node's address: Serve
    # binds them all on ingress.host, so a cluster needs 0.0.0.0 (manifests/serve/gpu.yaml).
    # On 127.0.0.1 the worker nodes' replicas are unreachable, HAProxy marks them down and
    # sends everything through Ray's Python fallback proxy (which answers 500 when a replica
    # dies). Every connection here still goes to a loopback address.
    "ingress.host=0.0.0.0",
)
KILL_AT_S, DURATION_S = 4.0, 16.0
START_WITHIN_S, REPLACED_WITHIN_S = 120.0, 120.0


WORKER_PORTS = (range(10002, 13000), range(13000, 16500), range(16500, 20000))
"""Each node's share of Ray's worker port range (head, worker 0, worker 1)."""
HEAD_IP = "127.0.0.2"
"""The head node's address (workers: 127.0.0.3, .4): loopback, but not 127.0.0.1 (see
``two_nodes``)."""


@dataclass
class Node:
    name: str
    process: subprocess.Popen[bytes]
    """``ray start --block``: the node's processes are its descendants."""
    node_manager_port: int

    def processes(self) -> list[psutil.Process]:
        """Every process of this node: ``ray start``'s descendants, and anything started
        with the node's raylet port (workers the raylet spawned, even if re-parented)."""
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.process.pid)
            found[root.pid] = root
            found.update({p.pid: p for p in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        marks = (f"node-manager-port={self.node_manager_port}",
                 f"node_manager_port={self.node_manager_port}")  # fmt: skip
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(p.info.get("cmdline") or [])
            if any(mark in cmdline for mark in marks):
                found[p.pid] = p
        return list(found.values())

    def node_id(self) -> str:
        for p in self.processes():
            for part in p.cmdline():
                if part.startswith("--node_id="):
                    return part.removeprefix("--node_id=")
        raise AssertionError(f"{self.name}: no raylet found")

    def kill(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM to ``ray start --block``, which stops its node (``stop`` waits for it)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, deadline_s: float) -> None:
        """Wait until ``deadline_s`` (monotonic) for the node to stop; kill what is left."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
        self.kill()


@dataclass
class TwoNodes:
    base_url: str
    dashboard_url: str
    head: Node
    workers: list[Node]
    environ: dict[str, str]
    """The environment every node and the deployer got (Redis URL and password included)."""
    auth: dict[str, str]
    """The cluster's token (Ray's token authentication), as its dashboard wants it."""

    def settings(self) -> Any:
        return load_config(overrides=list(APP_SETTINGS), environ=self.environ)

    def replicas(self) -> dict[str, str]:
        """Serve's live model replicas: unique id -> node id (Ray's state API, dashboard)."""
        alive = {"filter_keys": "state", "filter_predicates": "=", "filter_values": "ALIVE"}
        response = httpx.get(
            f"{self.dashboard_url}/api/v0/actors",
            params={"limit": 1000, "detail": 1, **alive},
            headers=self.auth,
            timeout=30,
        )
        response.raise_for_status()
        found = {}
        for actor in response.json()["data"]["result"]["result"]:
            name = actor.get("name") or ""
            if "ServeReplica" in (actor.get("class_name") or "") and "#Replica#" in name:
                found[name.rsplit("#", 1)[1]] = actor["node_id"]
        return found


def _ray(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "ray"), *args]


def _start_node(
    name: str, node_ip: str, workers: range, args: list[str], env: dict[str, str], logs: Path
) -> Node:
    """``ray start`` with every port it binds chosen here: nodes on one machine must not pick
    the same one (Ray's own random choices collided when two started at once)."""
    port = free_port()
    command = _ray(
        "start", "--block", f"--node-ip-address={node_ip}", f"--node-manager-port={port}",
        f"--object-manager-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
        f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}",
        "--disable-usage-stats", *args,
    )  # fmt: skip
    with (logs / f"{name}.log").open("w") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Node(name, process, port)


def _wait_for_nodes(
    dashboard_url: str,
    auth: dict[str, str],
    count: int,
    timeout_s: float,
    logs: Path,
    starting: Node | None = None,
) -> bool:
    """Wait for ``count`` alive Ray nodes: True once they are, False as soon as the node
    ``starting`` has given up (its ``ray start`` exited)."""
    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        if starting is not None and starting.process.poll() is not None:
            return False
        try:
            response = httpx.get(
                f"{dashboard_url}/api/v0/nodes", params={"limit": 100}, headers=auth
            )
            nodes = response.json()["data"]["result"]["result"]
            alive = sum(node["state"] == "ALIVE" for node in nodes)
            if alive >= count:
                return True
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-1500:]}" for log in logs.glob("*.log"))
    raise AssertionError(f"{alive} of {count} Ray nodes alive after {timeout_s} s\n{tails}")


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    password, token = secrets.token_urlsafe(16), secrets.token_hex(32)
    redis = LocalRedisServer(password=password)
    redis.start()
    run_dir = Path(tempfile.mkdtemp(prefix="pmh-", dir="/tmp"))
    temp_dir = tempfile.mkdtemp(prefix="pmray-", dir="/tmp")
    logs = run_dir / "logs"
    logs.mkdir()
    gcs_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    dashboard_url = f"http://127.0.0.1:{dashboard_port}"
    serving = load_config(overrides=[*APP_SETTINGS, f"ingress.port={http_port}"]).serving
    # What node-env.sh gives every node of a real cluster: no inherited Ray or Serve settings
    # of this test process's own cluster, Serve's HAProxy mode, the registry's address.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PREFIXMESH_"))}
    env |= haproxy_environment(serving, run_dir)
    env |= {
        "RAY_USAGE_STATS_ENABLED": "0",
        "PREFIXMESH_REDIS_URL": redis.url,
        "PREFIXMESH_REDIS_PASSWORD": password,
        # Token authentication, as a cluster people reach should run (Ray turns it on by
        # itself only where ~/.ray/auth_token exists: explicit, so the test does not vary).
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }
    auth = {"Authorization": f"Bearer {token}"}
    # Ray turns 127.0.0.1 (a node's, or the head's address a worker joins) into the machine's
    # own network address (docs/design.md §7); RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which stops
    # that, also refuses to start worker nodes. Other loopback addresses Ray leaves as they
    # are: each node gets one, and every listener and connection stays on loopback.
    head = _start_node("head", HEAD_IP, WORKER_PORTS[0], [
        "--head", f"--port={gcs_port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
    ], env, logs)  # fmt: skip
    workers: list[Node] = []
    try:
        _wait_for_nodes(dashboard_url, auth, 1, START_WITHIN_S, logs)
        worker_args = [f"--address={HEAD_IP}:{gcs_port}", "--num-cpus=1",
                       f"--resources={json.dumps({WORKER_RESOURCE: 2})}"]  # fmt: skip
        for i in range(2):  # one after the other: a raylet's start is heavy on 2 cores
            ip, ports = f"127.0.0.{3 + i}", WORKER_PORTS[1 + i]
            workers.append(_start_node(f"worker-{i}", ip, ports, worker_args, env, logs))
            if not _wait_for_nodes(dashboard_url, auth, 2 + i, START_WITHIN_S, logs, workers[i]):
                # `ray start` gives its raylet a fixed 30 s to register with the GCS (in
                # ray/_private/node.py), then exits: under two busy loops a worker ran out of
                # it. Started once more, as an operator would.
                workers[i].kill()
                workers[i] = _start_node(f"worker-{i}-again", ip, ports, worker_args, env, logs)
                assert _wait_for_nodes(
                    dashboard_url, auth, 2 + i, START_WITHIN_S, logs, workers[i]
                ), f"ray start of worker {i} gave up twice"
        deploy = [sys.executable, "-m", "prefixmesh.cli", "serve", "--detach",
                  f"--address={HEAD_IP}:{gcs_port}", "--set", f"ingress.port={http_port}",
                  "--set", f"cache_dir={Path('~/.cache/prefixmesh').expanduser()}"]  # fmt: skip
        deploy += [arg for setting in APP_SETTINGS for arg in ("--set", setting)]
        done = subprocess.run(
            deploy, env=env, capture_output=True, text=True, timeout=START_WITHIN_S, check=False
        )
        assert done.returncode == 0 and "prefixmesh is serving" in done.stdout, (
            done.stdout[-3000:] + done.stderr[-3000:]
        )
        assert "WARNING" not in done.stderr, done.stderr[-2000:]  # Redis reached, HAProxy on
        yield TwoNodes(f"http://127.0.0.1:{http_port}", dashboard_url, head, workers, env, auth)
    finally:
        # Every node stops at once: one after another took a minute of the suite.
        nodes = [*workers, head]
        for node in nodes:
            node.terminate()
        deadline_s = time.monotonic() + 10  # then SIGKILL: a node can sit 30 s in its stop
        for node in nodes:
            node.stop(deadline_s)
        stop_haproxy(run_dir)
        redis.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_replicas_on_the_workers_answer_the_openai_client(two_nodes: TwoNodes) -> None:
    from openai import OpenAI

    placed = two_nodes.replicas()
    worker_ids = {w.node_id() for w in two_nodes.workers}
    assert len(placed) == 2 and set(placed.values()) == worker_ids, (placed, worker_ids)
    client = OpenAI(base_url=f"{two_nodes.base_url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model=MODEL, prompt="Two nodes say", max_tokens=4)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    streamed = client.completions.create(
        model=MODEL, prompt="Two nodes stream", max_tokens=4, stream=True
    )
    assert sum(len(chunk.choices) for chunk in streamed) >= 1


def test_a_worker_node_killed_under_load(two_nodes: TwoNodes) -> None:
    """Worker 0 dies with everything on it; the other serves on and gets its replacement."""
    victim_node, survivor_node = two_nodes.workers
    victim_id, survivor_id = victim_node.node_id(), survivor_node.node_id()
    placed = two_nodes.replicas()
    [victim] = [replica for replica, node in placed.items() if node == victim_id]
    config = two_nodes.settings()
    marks: dict[str, float] = {}

    async def fault(run: LoadRun) -> None:
        await asyncio.sleep(KILL_AT_S)
        await asyncio.to_thread(victim_node.kill)
        marks["killed_at_s"] = run.now()
        registry = make_registry(config)
        await registry.connect()  # type: ignore[attr-defined]
        try:

            async def dropped() -> bool:
                return ReplicaId(victim) not in await registry.known_replicas()

            took = await wait_until(dropped, 30)
            if took is not None:
                marks["dropped_s"] = took
        finally:
            await registry.close()  # type: ignore[attr-defined]

    run = LoadRun(two_nodes.base_url)
    asyncio.run(run.run(DURATION_S, fault))

    replaced_at = time.monotonic() + REPLACED_WITHIN_S
    while time.monotonic() < replaced_at:
        now = two_nodes.replicas()
        if len(now) == 2 and set(now.values()) == {survivor_id}:
            break
        time.sleep(2)
    replaced = two_nodes.replicas()
    killed_at = marks["killed_at_s"] + 0.5  # a stream may see a first token as the node dies
    summary = run.summary(
        fault="worker node killed (SIGKILL to its raylet and every process on it)",
        registry_dropped_s=marks.get("dropped_s"),
        replicas_after=sorted(replaced.values()),
    )
    write_report("worker_node_killed", summary)
    assert not run.failed(), run.failed()[:5]
    # The direct path, not HAProxy's fallback: our router decided every request sent before
    # the kill (after it, one whose routing call failed may be balanced by HAProxy alone).
    before_kill = [o for o in run.outcomes if o.ok and o.answered_s < marks["killed_at_s"]]
    assert before_kill and all(o.routed_by not in ("", UNROUTED) for o in before_kill), [
        o for o in before_kill if o.routed_by in ("", UNROUTED)
    ][:5]
    for outcome in run.outcomes:
        if outcome.stream_error or outcome.cut:  # only streams running on the dead node
            assert outcome.stream and outcome.replica == victim, outcome
            assert outcome.sent_s <= killed_at, outcome
    assert summary["registry_dropped_s"] is not None, summary
    assert summary["registry_dropped_s"] <= config.registry.dead_after_s + 5, summary
    assert len(replaced) == 2 and set(replaced.values()) == {survivor_id}, replaced
    after = httpx.post(
        f"{two_nodes.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "After the node died", "max_tokens": 2},
        timeout=60,
    )
    assert after.status_code == 200, after.text
