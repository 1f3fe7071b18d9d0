"""``make deploy-check``: ``ray up`` of manifests/cluster/cluster-local.yaml for real on this
machine, then ``ray down``, and nothing of it left.

As root: makes the YAML's account if it is missing (never root: ``ray down`` runs a bare
``ray stop`` as that account) with the pip settings root's pip uses, removes its venv and copy
of the checkout (a clean install), starts an sshd of its own on 127.0.0.1 (a high port, a host
key and an authorized key made for this run, ``-D``, stopped by its PID), generates the Redis
password, and runs ``ray up`` on a copy of the YAML that differs only in the key and the
secrets folder it sends. Then it waits for the OpenAI endpoint of the Serve config, asks for one
completion with the ``openai`` client, stops the node the README's way (``ray exec`` of
``ray stop`` and stop-node.sh), ``ray down``s, and checks that the account runs nothing any
more. The teardown runs whatever failed before it; every wait is bounded. Exit 0 only when
every step passed.

    python -m deploy.deploy_check [--timeout-s 900] [--cold] [--keep-run-dir]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.deploy_plan import (
    AUTHORIZED_KEYS,
    Budget,
    DeployPlan,
    ProcessInfo,
    StepResult,
    account_processes,
    check_cluster,
    deployed_serve_config,
    missing_parts,
    off_loopback,
    ours_to_stop,
    passed,
    pip_conf,
    plan_from,
    report,
    served_model,
    sshd_config,
)

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "manifests" / "cluster" / "cluster-local.yaml"
UP_STEPS = ("prerequisites", "account", "sshd", "ray up", "endpoint", "completion", "head parts")
DOWN_STEPS = ("node stop", "ray down", "nothing left", "sshd stop")
RAY_UP_CAP_S = 600.0
ENDPOINT_CAP_S = 300.0
COMPLETION_CAP_S = 120.0
TEARDOWN_CAP_S = 120.0
"""Each of ``ray exec`` (the node's stop) and ``ray down``; both took under 10 s here."""
LEFTOVER_WAIT_S = 60.0
SESSION_WAIT_S = 20.0
TEARDOWN_RESERVE_S = 2 * TEARDOWN_CAP_S + LEFTOVER_WAIT_S + SESSION_WAIT_S + 40.0
"""What the teardown may take at most (its steps' caps, and the stops by PID after them):
kept from every step that brings something up, so the whole check ends within its limit."""
PROMPT = "def fib(n):"


class StepFailed(Exception):
    """A step's own verdict, with what to print."""


@dataclass(slots=True)
class Run:
    """The state one check builds up, for its teardown."""

    plan: DeployPlan
    budget: Budget
    run_dir: Path
    ray: Path
    home: Path | None = None
    uid: int | None = None
    ssh_port: int | None = None
    sshd: subprocess.Popen[bytes] | None = None
    cluster_file: Path | None = None
    ray_up_tried: bool = False
    model: str | None = None
    results: list[StepResult] = field(default_factory=list)


def step(run: Run, name: str, action: Callable[[], str]) -> bool:
    """Run one step, record how long it took and whether it passed."""
    print(f"== {name}", flush=True)
    started = time.monotonic()
    try:
        detail, ok = action(), True
    except StepFailed as failure:
        detail, ok = str(failure), False
    except (Exception, KeyboardInterrupt) as error:  # the teardown runs whatever happened
        detail, ok = f"{type(error).__name__}: {error}", False
    result = StepResult(name, ok, time.monotonic() - started, detail)
    run.results.append(result)
    print(f"   {'ok' if ok else 'FAILED'} in {result.seconds:.1f} s: {detail}", flush=True)
    return ok


def run_logged(command: list[str], log: Path, timeout_s: float) -> int | None:
    """Run a command of ours with its output in ``log``; its process group is stopped (by its
    PID) when it outlives ``timeout_s``: None then."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(command)}\n".encode())
        out.flush()
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            stop_group(process)
            return None


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group our child leads, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)
            return


def tail(log: Path, lines: int = 30) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:])


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a connection of ours in TIME_WAIT there does not
    count: servers bind with SO_REUSEADDR too)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def processes() -> list[ProcessInfo]:
    import psutil

    found = []
    for process in psutil.process_iter(["uids", "create_time", "cmdline", "name"]):
        info = process.info
        if info.get("uids") is None:
            continue
        command = " ".join(info.get("cmdline") or []) or info.get("name") or ""
        found.append(ProcessInfo(process.pid, info["uids"].real, info["create_time"], command))
    return found


def wait_until(done: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for child in path.rglob("*"):
        os.chown(child, uid, gid)


# -- the steps that bring the cluster up ---------------------------------------------------


def prerequisites(run: Run) -> str:
    if os.geteuid() != 0:
        raise StepFailed("run as root: it makes the cluster's account and runs an sshd")
    tools = ["sshd", "ssh", "ssh-keygen", "rsync", "useradd", "usermod"]
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise StepFailed(f"missing {missing}: apt-get install -y openssh-server rsync")
    if not run.ray.exists():
        raise StepFailed(f"no {run.ray}: make install")
    import openai  # noqa: F401  (the client the completion is sent with)

    busy = [p for p in run.plan.listen_ports if not port_free(p)]
    if busy:
        raise StepFailed(f"ports of the cluster already in use on 127.0.0.1: {busy}")
    return f"ports {list(run.plan.listen_ports)} free"


def account(run: Run, cold: bool) -> str:
    user = run.plan.ssh_user
    made = ""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", user], check=True)
        made = "made; "
        entry = pwd.getpwnam(user)
    # '*': no password to log in with, and not locked (sshd refuses a locked account's keys).
    subprocess.run(["usermod", "-p", "*", user], check=True)
    if entry.pw_uid == 0:
        raise StepFailed(f"{user} is uid 0: ray down's ray stop would stop every Ray here")
    run.uid, run.home = entry.pw_uid, Path(entry.pw_dir)
    running = account_processes(processes(), entry.pw_uid)
    if running:
        shown = "; ".join(f"{p.pid} {p.command[:60]}" for p in running[:5])
        raise StepFailed(f"{user} already runs {len(running)} processes (a cluster?): {shown}")
    # A clean install: setup-node.sh makes the venv again, ray up copies the checkout again.
    removed = ["prefixmesh-venv", "prefixmesh", *([".cache"] if cold else [])]
    for name in removed:
        shutil.rmtree(run.home / name, ignore_errors=True)
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    conf = run.home / ".config" / "pip" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(pip_conf(listing))
    (run.home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    for path in (run.home / ".config", run.home / ".ssh"):
        chown_tree(path, entry.pw_uid, entry.pw_gid)
    return f"{user} (uid {entry.pw_uid}) {made}removed ~/{{{','.join(removed)}}}; pip.conf"


def start_sshd(run: Run, port: int | None, proxy_command: str) -> str:
    assert run.home is not None and run.uid is not None
    keys = run.run_dir / "keys"
    keys.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-C", f"deploy-check {name}", "-f", str(keys / name)], check=True)
    authorized = run.home / AUTHORIZED_KEYS
    authorized.write_bytes((keys / "client_key.pub").read_bytes())
    authorized.chmod(0o600)
    os.chown(authorized, run.uid, pwd.getpwuid(run.uid).pw_gid)
    run.ssh_port = port or free_port()
    config = run.run_dir / "sshd_config"
    config.write_text(sshd_config(run.ssh_port, str(keys / "host_key"), run.plan.ssh_user))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    sshd = shutil.which("sshd") or "sshd"
    test = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True)
    if test.returncode != 0:
        raise StepFailed(f"sshd -t: {test.stderr.strip()}")
    with (run.run_dir / "sshd.log").open("ab") as log:
        run.sshd = subprocess.Popen(
            [sshd, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def listening() -> bool:
        if run.sshd is not None and run.sshd.poll() is not None:
            raise StepFailed(f"sshd exited: {tail(run.run_dir / 'sshd.log', 5)}")
        return not port_free(run.ssh_port or 0)

    if not wait_until(listening, 10.0, 0.1):
        raise StepFailed("sshd did not listen within 10 s")
    # ray up retries a refused login for minutes: try the YAML's own proxy command first.
    login = subprocess.run(
        [
            "env",
            f"PREFIXMESH_SSH_PORT={run.ssh_port}",
            "ssh",
            "-i",
            str(keys / "client_key"),
            *("-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR"),
            *("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"),
            *("-o", f"ProxyCommand={proxy_command}"),
            f"{run.plan.ssh_user}@{run.plan.head_ip}",
            "id -un",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if login.stdout.strip() != run.plan.ssh_user:
        raise StepFailed(f"ssh through the YAML's proxy command: {login.stderr.strip()}")
    return f"pid {run.sshd.pid} on 127.0.0.1:{run.ssh_port}; ssh through the proxy command"


def write_cluster_file(run: Run, cluster: dict[str, Any]) -> Path:
    secrets_dir = run.run_dir / "secrets"
    secrets_dir.mkdir(mode=0o700)
    password = secrets_dir / "redis-password"
    password.write_text(secrets.token_hex(32) + "\n")
    password.chmod(0o600)
    derived = check_cluster(cluster, str(run.run_dir / "keys" / "client_key"), str(secrets_dir))
    path = run.run_dir / "cluster-local.yaml"
    path.write_text(yaml.safe_dump(derived, sort_keys=False))
    return path


def ray_command(run: Run, *args: str) -> list[str]:
    # Ray 2.60 has no SSH port setting: the YAML's proxy command dials $PREFIXMESH_SSH_PORT.
    return [
        "env",
        f"PREFIXMESH_SSH_PORT={run.ssh_port}",
        str(run.ray),
        *args,
        "--log-style=record",
        "--log-color=false",
    ]


def ray_up(run: Run, cluster: dict[str, Any]) -> str:
    run.cluster_file = write_cluster_file(run, cluster)
    log = run.run_dir / "ray-up.log"
    timeout_s = run.budget.for_step(time.monotonic(), RAY_UP_CAP_S)
    run.ray_up_tried = True
    code = run_logged(
        ray_command(run, "up", "-y", "--no-config-cache", str(run.cluster_file)), log, timeout_s
    )
    if code != 0:
        why = f"timed out after {timeout_s:.0f} s" if code is None else f"exit {code}"
        raise StepFailed(f"ray up {why}; {log}:\n{tail(log)}")
    return f"log {log}"


def models(base_url: str) -> Any:
    with urllib.request.urlopen(f"{base_url}/models", timeout=5) as answer:
        return json.load(answer)


def endpoint(run: Run) -> str:
    timeout_s = run.budget.for_step(time.monotonic(), ENDPOINT_CAP_S)
    last = ["no answer yet"]

    def ready() -> bool:
        try:
            run.model = served_model(models(run.plan.base_url))
        except (OSError, ValueError) as error:  # refused, reset, 5xx, not JSON yet
            last[0] = f"{type(error).__name__}: {error}"
        return run.model is not None

    if not wait_until(ready, timeout_s, 2.0):
        raise StepFailed(f"{run.plan.base_url}/models not ready in {timeout_s:.0f} s ({last[0]})")
    return f"{run.plan.base_url} serves {run.model}"


def completion(run: Run) -> str:
    import openai

    timeout_s = run.budget.for_step(time.monotonic(), COMPLETION_CAP_S)
    client = openai.OpenAI(
        base_url=run.plan.base_url, api_key="deploy-check", max_retries=0, timeout=timeout_s
    )
    assert run.model is not None
    answer = client.completions.create(model=run.model, prompt=PROMPT, max_tokens=16, temperature=0)
    tokens = answer.usage.completion_tokens if answer.usage else 0
    if not answer.choices or tokens < 1:
        raise StepFailed(f"no tokens in the answer: {answer}")
    return f"{tokens} tokens for {PROMPT!r}: {answer.choices[0].text!r}"


def head_parts(run: Run) -> str:
    """Every part of the deployment runs under the account, and what listens beyond loopback."""
    import psutil

    assert run.uid is not None
    mine = account_processes(processes(), run.uid, sessions=False)
    missing = missing_parts(p.command for p in mine)
    commands = {p.pid: p.command for p in mine}
    listeners = [
        (c.laddr.ip, c.laddr.port, commands[c.pid])
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in commands
    ]
    if missing:
        raise StepFailed(f"not running under {run.plan.ssh_user}: {missing}")
    wide = off_loopback(listeners)
    return (
        f"{len(mine)} processes, {len(listeners)} listeners; beyond loopback: "
        f"{', '.join(wide) if wide else 'none'}"
    )


# -- the teardown, which runs whatever happened above ----------------------------------------


def node_stop(run: Run) -> str:
    """README's step: ray stop leaves HAProxy and the registry Redis; stop-node.sh stops them."""
    assert run.cluster_file is not None
    log = run.run_dir / "ray-down.log"
    command = f"ray stop && bash ~/prefixmesh/manifests/cluster/stop-node.sh {run.plan.redis_port}"
    timeout_s = run.budget.for_teardown(time.monotonic(), TEARDOWN_CAP_S)
    code = run_logged(ray_command(run, "exec", str(run.cluster_file), command), log, timeout_s)
    if code != 0:
        raise StepFailed(f"ray exec '{command}': exit {code}; {log}:\n{tail(log)}")
    return command


def ray_down(run: Run) -> str:
    assert run.cluster_file is not None
    log = run.run_dir / "ray-down.log"
    timeout_s = run.budget.for_teardown(time.monotonic(), TEARDOWN_CAP_S)
    code = run_logged(ray_command(run, "down", "-y", str(run.cluster_file)), log, timeout_s)
    if code != 0:
        raise StepFailed(f"ray down: exit {code}; {log}:\n{tail(log)}")
    return f"log {log}"


def stop_sshd(run: Run) -> None:
    if run.sshd is not None and run.sshd.poll() is None:
        run.sshd.terminate()  # by the PID of the -D process we started
        try:
            run.sshd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            run.sshd.kill()
            run.sshd.wait(timeout=5)


def nothing_left(run: Run, since_s: float) -> str:
    """The account runs nothing (Ray, HAProxy, Redis, SSH sessions) once ray down is done and
    the sshd is stopped; what it still runs is named, then stopped by its PID."""
    assert run.uid is not None
    uid = run.uid

    def deployment_gone() -> bool:
        return not account_processes(processes(), uid, sessions=False)

    settled = wait_until(deployment_gone, LEFTOVER_WAIT_S)
    stop_sshd(run)
    # The SSH sessions end with ray's master connection (ControlPersist 10 s).
    wait_until(lambda: not account_processes(processes(), uid), SESSION_WAIT_S)
    left = account_processes(processes(), uid)
    busy = [p for p in run.plan.listen_ports if not port_free(p)]
    if settled and not left and not busy:
        return f"no process of {run.plan.ssh_user}; ports {list(run.plan.listen_ports)} free"
    shown = "; ".join(f"{p.pid} {p.command[:80]}" for p in left[:10])
    stopped = stop_pids([p.pid for p in ours_to_stop(left, uid, since_s)])
    raise StepFailed(
        f"left after ray down: {len(left)} processes ({shown}); busy ports {busy}; "
        f"stopped {stopped}"
    )


def stop_pids(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            process.terminate()
            alive.append(process)
    _, still = psutil.wait_procs(alive, timeout=5)
    for process in still:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return [p.pid for p in alive]


def sshd_stopped(run: Run) -> str:
    stop_sshd(run)
    if run.sshd is not None and run.sshd.poll() is None:
        raise StepFailed(f"sshd {run.sshd.pid} still runs")
    return f"sshd {run.sshd.pid if run.sshd else '-'} stopped"


def teardown(run: Run, since_s: float) -> None:
    if run.ray_up_tried:
        step(run, "node stop", lambda: node_stop(run))
        step(run, "ray down", lambda: ray_down(run))
    if run.uid is not None:
        step(run, "nothing left", lambda: nothing_left(run, since_s))
    step(run, "sshd stop", lambda: sshd_stopped(run))
    if run.home is not None:
        (run.home / AUTHORIZED_KEYS).unlink(missing_ok=True)


def timings(results: list[StepResult]) -> str:
    took = {r.name: r.seconds for r in results}
    up = sum(took.get(n, 0.0) for n in ("ray up", "endpoint", "completion"))
    down = sum(took.get(n, 0.0) for n in DOWN_STEPS)
    return (
        f"clean venv -> answered completion: {up:.0f} s (ray up {took.get('ray up', 0):.0f} s, "
        f"endpoint {took.get('endpoint', 0):.0f} s); teardown (node stop, ray down, checks): "
        f"{down:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy-check", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, default=CLUSTER_YAML, help="cluster YAML")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the whole check's limit")
    parser.add_argument("--ssh-port", type=int, help="the sshd's port (default: a free one)")
    parser.add_argument(
        "--cold", action="store_true", help="also remove the account's caches (pip, demo model)"
    )
    parser.add_argument("--keep-run-dir", action="store_true", help="keep logs after a pass")
    args = parser.parse_args(argv)

    started_wall, started = time.time(), time.monotonic()
    cluster = yaml.safe_load(args.cluster.read_text())
    serve_config = ROOT / deployed_serve_config(cluster)
    plan = plan_from(cluster, yaml.safe_load(serve_config.read_text()))
    run = Run(
        plan=plan,
        budget=Budget(started, args.timeout_s, teardown_s=TEARDOWN_RESERVE_S),
        run_dir=Path(tempfile.mkdtemp(prefix="pmh-deploy-check-")),
        ray=Path(sys.executable).parent / "ray",
    )
    print(f"deploy-check: {args.cluster.relative_to(ROOT)}, files in {run.run_dir}", flush=True)
    proxy = cluster["auth"].get("ssh_proxy_command") or "none"
    try:
        _ = (
            step(run, "prerequisites", lambda: prerequisites(run))
            and step(run, "account", lambda: account(run, args.cold))
            and step(run, "sshd", lambda: start_sshd(run, args.ssh_port, proxy))
            and step(run, "ray up", lambda: ray_up(run, cluster))
            and step(run, "endpoint", lambda: endpoint(run))
            and step(run, "completion", lambda: completion(run))
            and step(run, "head parts", lambda: head_parts(run))
        )
    finally:
        teardown(run, started_wall - 1.0)
    ok = passed(run.results, (*UP_STEPS, *DOWN_STEPS))
    print(report(run.results))
    if run.ray_up_tried:
        print(timings(run.results))
    print(f"whole check: {time.monotonic() - started:.0f} s")
    shutil.rmtree(run.run_dir / "keys", ignore_errors=True)
    shutil.rmtree(run.run_dir / "secrets", ignore_errors=True)
    if ok and not args.keep_run_dir:
        shutil.rmtree(run.run_dir, ignore_errors=True)
    else:
        print(f"logs: {run.run_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
