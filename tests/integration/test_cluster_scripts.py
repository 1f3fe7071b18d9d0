"""The scripts the `ray up` cluster YAMLs run, run for real on this machine: node-env.sh sets the
registry's address and password and Serve's HAProxy settings (from the Serve config, through
prefixmesh.local_ray), start-redis.sh starts a Redis that wants that password and never shows it
on its command line, and stop-node.sh stops it (and HAProxy, which `ray stop` leaves)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
import yaml

from prefixmesh.config import load_config, merge_overrides
from prefixmesh.loadtest.local_redis import find_redis_server
from prefixmesh.local_ray import haproxy_environment
from prefixmesh.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "manifests" / "cluster"
VENV = Path(sys.prefix)
PASSWORD = "a b\"c\\d'e$f"  # spaces, both quotes, a backslash and a dollar survive


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    folder = tmp_path / "secrets"
    folder.mkdir()
    (folder / "redis-password").write_text(PASSWORD + "\n")
    return folder


def _node_env(serve_config: str, secrets: Path, then: str) -> subprocess.CompletedProcess[str]:
    script = (
        f". {SCRIPTS / 'node-env.sh'} 10.1.2.3 16379 {ROOT / serve_config} {VENV} {secrets}"
        f" && {then}"
    )
    return _bash(script, {"HOME": os.environ.get("HOME", "/tmp"), "PATH": os.environ["PATH"]})


def test_node_env_sets_the_registry_and_haproxy_settings(secrets: Path) -> None:
    done = _node_env("manifests/serve/gpu.yaml", secrets, "env -0")
    assert done.returncode == 0, done.stderr
    env = dict(line.partition("=")[::2] for line in done.stdout.split("\0") if line)
    assert env["PREFIXMESH_REDIS_URL"] == "redis://10.1.2.3:16379/0"
    assert env["PREFIXMESH_REDIS_PASSWORD"] == PASSWORD
    assert env["PATH"].split(":")[0] == f"{VENV}/bin"
    serve_config = yaml.safe_load((ROOT / "manifests/serve/gpu.yaml").read_text())
    settings = serve_config["applications"][0]["args"]["settings"]
    serving = load_config(None, merge_overrides(settings, [])).serving
    expected = haproxy_environment(serving, f"/tmp/pmh-{os.getuid()}-node", port=lambda: 0)
    free = {k for k, v in expected.items() if v == "0"}  # ports node-env.sh picked free
    assert {k: v for k, v in env.items() if k.startswith("RAY_SERVE_")}.keys() == expected.keys()
    for name, value in expected.items():
        if name in free:
            assert 0 < int(env[name]) < 65536
        else:
            assert env[name] == value, name
    assert env["RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"] == "2"


def test_node_env_without_a_password_stops_the_command(tmp_path: Path) -> None:
    done = _node_env("manifests/serve/gpu.yaml", tmp_path, "echo started")
    assert done.returncode != 0
    assert "started" not in done.stdout
    assert "no Redis password" in done.stderr


def test_node_env_leaves_haproxy_off_on_the_proxy_path(secrets: Path, tmp_path: Path) -> None:
    serve_config = tmp_path / "proxy.yaml"
    text = (ROOT / "manifests/serve/cluster-local.yaml").read_text()
    serve_config.write_text(text.replace("registry: {backend: redis}", "serving: {path: proxy}"))
    done = _node_env(str(serve_config), secrets, "env")
    assert done.returncode == 0, done.stderr
    assert "PREFIXMESH_REDIS_URL=redis://10.1.2.3:16379/0" in done.stdout
    assert "RAY_SERVE_" not in done.stdout


@pytest.fixture
def redis_bin() -> Path:
    folder = Path(find_redis_server()).parent
    if not (folder / "redis-cli").exists():
        pytest.skip(f"no redis-cli next to {folder / 'redis-server'}")
    return folder


@pytest.fixture
def registry_port() -> Iterator[int]:
    port = free_port()
    run = Path(f"/tmp/prefixmesh-redis-{os.getuid()}-{port}")
    yield port
    pidfile = run.with_suffix(".pid")
    if pidfile.exists():  # the server start-redis.sh started, by its PID
        pid = int(pidfile.read_text())
        if _alive(pid):
            psutil.Process(pid).terminate()
            psutil.wait_procs([psutil.Process(pid)], timeout=10)
    for suffix in (".pid", ".log"):
        run.with_suffix(suffix).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.redis
def test_start_redis_wants_the_password_and_hides_it(redis_bin: Path, registry_port: int) -> None:
    env = {
        "PATH": f"{redis_bin}:{os.environ['PATH']}",
        "PREFIXMESH_REDIS_URL": f"redis://127.0.0.1:{registry_port}/0",
        "PREFIXMESH_REDIS_PASSWORD": PASSWORD,
    }
    pidfile = Path(f"/tmp/prefixmesh-redis-{os.getuid()}-{registry_port}.pid")
    pids = []
    for _ in range(2):  # a second `ray up` replaces the first server
        done = _bash(f"bash {SCRIPTS / 'start-redis.sh'}", env)
        assert done.returncode == 0, done.stderr
        pids.append(int(pidfile.read_text()))
        assert PASSWORD not in " ".join(psutil.Process(pids[-1]).cmdline())
    assert pids[0] != pids[1] and not _alive(pids[0])
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=registry_port).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=registry_port, password="wrong").ping()
    assert redis.Redis(port=registry_port, password=PASSWORD).ping()


@pytest.mark.redis
def test_stop_node_stops_the_registry_redis(redis_bin: Path, registry_port: int) -> None:
    env = {
        "PATH": f"{redis_bin}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/tmp"),
        "PREFIXMESH_REDIS_URL": f"redis://127.0.0.1:{registry_port}/0",
        "PREFIXMESH_REDIS_PASSWORD": PASSWORD,
    }
    pidfile = Path(f"/tmp/prefixmesh-redis-{os.getuid()}-{registry_port}.pid")
    assert _bash(f"bash {SCRIPTS / 'start-redis.sh'}", env).returncode == 0
    pid = int(pidfile.read_text())
    done = _bash(f"bash {SCRIPTS / 'stop-node.sh'} {registry_port} {VENV}", env)
    assert done.returncode == 0, done.stderr
    assert "stopped HAProxy []" in done.stdout  # none runs under this account's node folder
    assert f"stopped the registry Redis on port {registry_port} (pid {pid})" in done.stdout
    assert not _alive(pid)
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=registry_port, password=PASSWORD).ping()
