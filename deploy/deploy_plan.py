"""What ``make deploy-check`` does, decided without I/O: the facts it reads from the cluster YAML
and its Serve config (account, ports, the API's address), the copy of the YAML it runs (only
the SSH key and the secrets folder on the operator's side differ), its sshd's configuration,
the pip settings the cluster's account gets, the time budget of each step, which processes of
the account are left, and the report. ``deploy_check.py`` does the I/O.
"""

from __future__ import annotations

import ast
import copy
import ipaddress
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

SECRETS_MOUNT = "~/.prefixmesh-secrets"
"""The file mount that carries the Redis password to the nodes (README, Run on a cluster)."""
AUTHORIZED_KEYS = ".ssh/deploy-check-authorized-keys"
"""The check's sshd reads only this file (relative to the account's home): the run's key never
lands in the account's own authorized_keys, and no other sshd accepts it."""

_NODE_ENV = re.compile(r"^\. ~/prefixmesh/manifests/cluster/node-env\.sh (\S+) (\d+) (\S+) && ")
_RAY_PORT_FLAGS = (
    "port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "ray-client-server-port",
)
_WORKER_PORT_FLAGS = ("min-worker-port", "max-worker-port")


class PlanError(ValueError):
    """The cluster YAML or its Serve config cannot be checked as it stands."""


@dataclass(frozen=True, slots=True)
class DeployPlan:
    """What the check needs to know about the cluster it brings up."""

    ssh_user: str
    head_ip: str
    redis_port: int
    http_host: str
    http_port: int
    ray_ports: tuple[int, ...]
    """The head's fixed listeners (GCS, dashboard, agent, client server), from its ray start."""
    worker_ports: tuple[int, int]
    """Ray's worker port range (inclusive)."""

    @property
    def base_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}/v1"

    @property
    def listen_ports(self) -> tuple[int, ...]:
        """Every fixed port the cluster binds on the head: free before ``ray up``."""
        return (*self.ray_ports, self.redis_port, self.http_port)


def _flags(command: str) -> dict[str, str]:
    return {
        word[2:].partition("=")[0]: word[2:].partition("=")[2]
        for word in shlex.split(command)
        if word.startswith("--")
    }


def deployed_serve_config(cluster: Mapping[str, Any]) -> str:
    """The repository path of the Serve config the head deploys (``~/prefixmesh/...`` there)."""
    deploy = [c for c in cluster.get("head_start_ray_commands") or [] if "serve deploy" in c]
    if not deploy:
        raise PlanError("no `serve deploy` in head_start_ray_commands")
    target = shlex.split(deploy[0])[-1]
    if not target.startswith("~/prefixmesh/"):
        raise PlanError(f"the head deploys a Serve config outside the checkout: {target}")
    return target.removeprefix("~/prefixmesh/")


def plan_from(cluster: Mapping[str, Any], serve: Mapping[str, Any]) -> DeployPlan:
    """The plan of a one-node local-provider cluster YAML and the Serve config it deploys."""
    user = cluster.get("auth", {}).get("ssh_user", "")
    if not user or user == "root":
        # ray down runs a bare `ray stop` as this account: as root it would stop every Ray
        # process on the machine, other people's clusters included.
        raise PlanError(f"auth.ssh_user must be an account of its own, not {user!r}")
    if cluster.get("provider", {}).get("type") != "local":
        raise PlanError("the check brings up Ray's local provider only")
    head = list(cluster.get("head_start_ray_commands") or [])
    start = next((c for c in head if "ray start --head" in c), None)
    if start is None:
        raise PlanError("no `ray start --head` in head_start_ray_commands")
    sourced = _NODE_ENV.match(start)
    if sourced is None:
        raise PlanError("the head's ray start does not source node-env.sh first")
    head_ip, redis_port, _ = sourced.groups()
    flags = _flags(start)
    missing = [f for f in (*_RAY_PORT_FLAGS, *_WORKER_PORT_FLAGS) if f not in flags]
    if missing:
        # Ray's defaults are the ports other clusters on the machine use.
        raise PlanError(f"the head's ray start leaves ports to Ray's defaults: {missing}")
    http = serve.get("http_options") or {}
    if "port" not in http:
        raise PlanError("the Serve config leaves http_options.port to Serve's default")
    return DeployPlan(
        ssh_user=user,
        head_ip=head_ip,
        redis_port=int(redis_port),
        http_host=http.get("host", "127.0.0.1"),
        http_port=int(http["port"]),
        ray_ports=tuple(int(flags[f]) for f in _RAY_PORT_FLAGS),
        worker_ports=(int(flags["min-worker-port"]), int(flags["max-worker-port"])),
    )


def check_cluster(cluster: Mapping[str, Any], private_key: str, secrets_dir: str) -> dict[str, Any]:
    """The YAML the check runs: the same cluster, with the run's own SSH key and its secrets
    folder (a generated Redis password) as the operator-side sources. The nodes see the same
    paths as with the original (~/ray_bootstrap_key.pem, ~/.prefixmesh-secrets)."""
    if SECRETS_MOUNT not in (cluster.get("file_mounts") or {}):
        raise PlanError(f"file_mounts has no {SECRETS_MOUNT} (the Redis password's folder)")
    derived = copy.deepcopy(dict(cluster))
    derived["auth"]["ssh_private_key"] = private_key
    derived["file_mounts"][SECRETS_MOUNT] = secrets_dir
    return derived


def sshd_config(port: int, host_key: str, user: str) -> str:
    """An sshd on 127.0.0.1:``port`` that lets ``user`` in with the key in
    ``AUTHORIZED_KEYS`` and nothing else (no passwords, no root)."""
    return "\n".join(
        [
            f"Port {port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {host_key}",
            "PidFile none",  # the check owns it by the PID of its -D process
            f"AuthorizedKeysFile {AUTHORIZED_KEYS}",
            f"AllowUsers {user}",
            "PermitRootLogin no",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes yes",
            # ray up multiplexes its commands and rsyncs over one master connection.
            "MaxSessions 32",
            "MaxStartups 32",
            "X11Forwarding no",
            "PrintMotd no",
            "LogLevel INFO",
            "",
        ]
    )


def pip_conf(listing: str) -> str:
    """A pip.conf with the settings of ``pip config list`` (files and ``PIP_*`` variables of the
    account that runs the check): the cluster's account reaches the same package index and
    local wheels. Keys without a section (``:env:``) go to ``[global]``."""
    sections: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        section, _, name = key.rpartition(".")
        section = "global" if section in ("", ":env:") else section
        sections.setdefault(section, {})[name] = str(ast.literal_eval(value))
    lines: list[str] = []
    for section in sorted(sections, key=lambda s: (s != "global", s)):
        lines.append(f"[{section}]")
        lines += [f"{name} = {value}" for name, value in sorted(sections[section].items())]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Budget:
    """The whole check's time limit: each step gets at most its own cap and never more than
    what is left after the teardown's reserve."""

    started_s: float
    total_s: float
    teardown_s: float

    def left(self, now_s: float) -> float:
        return self.started_s + self.total_s - now_s

    def for_step(self, now_s: float, cap_s: float) -> float:
        """Seconds a step that brings something up may take now (0 when none are left)."""
        return max(0.0, min(cap_s, self.left(now_s) - self.teardown_s))

    def for_teardown(self, now_s: float, cap_s: float) -> float:
        """Seconds a teardown step may take: its cap, within the whole limit, and never
        below a short minimum (a teardown that cannot run leaves the cluster up)."""
        return max(10.0, min(cap_s, self.left(now_s)))


@dataclass(frozen=True, slots=True)
class StepResult:
    name: str
    ok: bool
    seconds: float
    detail: str = ""


def report(results: Iterable[StepResult]) -> str:
    """One line per step, then the verdict naming the first failed step."""
    steps = list(results)
    lines = [
        f"  {'ok ' if r.ok else 'FAIL'} {r.name:<22} {r.seconds:7.1f} s  {r.detail}".rstrip()
        for r in steps
    ]
    failed = [r.name for r in steps if not r.ok]
    verdict = f"deploy-check FAILED at: {', '.join(failed)}" if failed else "deploy-check passed"
    return "\n".join([*lines, verdict])


def passed(results: Iterable[StepResult], required: Iterable[str]) -> bool:
    """Every required step ran and none failed."""
    steps = list(results)
    ran = {r.name for r in steps}
    return all(r.ok for r in steps) and set(required) <= ran


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    uid: int
    started_s: float
    command: str


def account_processes(
    processes: Iterable[ProcessInfo], uid: int, sessions: bool = True
) -> list[ProcessInfo]:
    """The account's processes; ``sessions=False`` leaves out its SSH sessions (sshd's
    per-connection processes, which end a few seconds after ray's SSH master connection)."""
    return [
        p
        for p in processes
        if p.uid == uid and (sessions or not p.command.startswith(("sshd:", "sshd-session")))
    ]


def ours_to_stop(processes: Iterable[ProcessInfo], uid: int, since_s: float) -> list[ProcessInfo]:
    """What the check may stop after a failed teardown: the account's processes that began
    after the check did (the check refuses to start while the account runs anything)."""
    return [p for p in processes if p.uid == uid and p.started_s >= since_s]


HEAD_PARTS = (
    ("GCS", "gcs_server"),
    ("raylet", "raylet"),
    ("autoscaler", "/monitor.py"),  # autoscaler/v2/ or _private/; not log_monitor.py
    ("dashboard", "dashboard/dashboard.py"),
    ("Serve controller", "ServeController"),
    ("Serve replica", "ServeReplica:"),
    ("HAProxy", "haproxy"),
    ("registry Redis", "redis-server"),
)
"""What a running head holds (a name, a part of its command line): Ray's own processes, the
app's, Serve's HAProxy and the registry."""


def missing_parts(commands: Iterable[str]) -> list[str]:
    """The parts of ``HEAD_PARTS`` no command runs (the autoscaler crashed, no replica...)."""
    running = list(commands)
    return [name for name, marker in HEAD_PARTS if not any(marker in c for c in running)]


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4 loopback seen through an IPv6 socket (::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def off_loopback(listeners: Iterable[tuple[str, int, str]]) -> list[str]:
    """``(address, port, command)`` listeners bound beyond loopback, as ``program@address:port``
    (Serve's replicas open a gRPC listener on every interface that Ray hard-codes:
    docs/design.md §7)."""
    return sorted(
        f"{PurePosixPath(command.split()[0]).name if command else '?'}@{address}:{port}"
        for address, port, command in listeners
        if not is_loopback(address)
    )


def served_model(payload: Any) -> str | None:
    """The first model id of a ``/v1/models`` answer; None until the app lists one."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) and model else None
    return None
