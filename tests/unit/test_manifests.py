"""Every manifest is checked offline: configs load, Serve configs build the app, cluster YAMLs
pass Ray's own validation and start every process after node-env.sh, the RayService's embedded
Serve config passes Ray's schema and builds, its secrets come from Secrets, and the image the
Dockerfile builds is the one the manifests name. (The scripts the cluster YAMLs run are run for
real in tests/integration/test_cluster_scripts.py.)"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefixmesh.config import PrefixmeshConfig, ServingConfig, load_config, merge_overrides
from prefixmesh.local_ray import haproxy_environment

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
CONFIGS = sorted(MANIFESTS.glob("*.yaml"))
SERVE_CONFIGS = sorted((MANIFESTS / "serve").glob("*.yaml"))
CLUSTERS = sorted((MANIFESTS / "cluster").glob("*.yaml"))
GPU_CLUSTERS = [p for p in CLUSTERS if p.name != "cluster-local.yaml"]
RAYSERVICE = MANIFESTS / "kuberay" / "rayservice.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
RAY_DEFAULT_PORTS = {
    "port": 6379,
    "dashboard-port": 8265,
    "dashboard-agent-listen-port": 52365,
    "ray-client-server-port": 10001,
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_manifest_loads(path: Path) -> None:
    assert isinstance(load_config(path), PrefixmeshConfig)


def test_local_manifest_is_the_embedded_default() -> None:
    assert load_config(MANIFESTS / "local.yaml") == PrefixmeshConfig()


def _build(serve_config: dict[str, Any], cache_dir: Path) -> list[Any]:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    apps = []
    for app in schema.applications:
        module, _, name = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), name)
        args = dict(app.args)
        args["overrides"] = [*args.get("overrides", []), f"cache_dir={cache_dir}"]
        apps.append(builder(args))
    return apps


def _app_config(serve_config: dict[str, Any]) -> PrefixmeshConfig:
    """The config ``app_builder`` builds the (first) application from."""
    args = serve_config["applications"][0].get("args") or {}
    settings = merge_overrides(args.get("settings") or {}, args.get("overrides") or [])
    return load_config(args.get("config"), settings)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_serve_config_builds_the_app(path: Path, tmp_path: Path) -> None:
    from ray.serve import Application

    apps = _build(yaml.safe_load(path.read_text()), tmp_path)
    assert apps and all(isinstance(a, Application) for a in apps)


# --- `ray up` cluster YAMLs ---------------------------------------------------------------


def _cluster(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def _all_commands(config: dict[str, Any]) -> Iterator[str]:
    for key in (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        yield from config.get(key) or []


_SOURCES_NODE_ENV = re.compile(
    r"\. ~/prefixmesh/manifests/cluster/node-env\.sh (\$\([^)]*\)|\S+) (\d+) (\S+) && \S"
)


def _node_env_args(command: str) -> list[str]:
    """HEAD_IP REDIS_PORT SERVE_CONFIG of the node-env.sh a command sources first."""
    sourced = _SOURCES_NODE_ENV.match(command)
    assert sourced, f"does not start by sourcing node-env.sh: {command}"
    return list(sourced.groups())


def _flags(command: str) -> dict[str, str]:
    return dict(w[2:].partition("=")[::2] for w in shlex.split(command) if w.startswith("--"))


def _serve_config_of(path: Path) -> Path:
    deploy = next(c for c in _cluster(path)["head_start_ray_commands"] if "serve deploy" in c)
    target = shlex.split(deploy)[-1]
    assert target.startswith("~/prefixmesh/"), target
    return ROOT / target.removeprefix("~/prefixmesh/")


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_cluster_yaml_passes_rays_validation(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _cluster(path)
    validate_config(prepare_config(config))  # what `ray up` does first; raises on a violation
    head = config["head_start_ray_commands"]
    assert [c for c in head if "start-redis.sh" in c]
    assert [c for c in head if "ray start --head" in c]
    assert [c for c in head if "serve deploy" in c]
    # `ray stop` stops every Ray process of the account, other clusters' included.
    assert not [c for c in _all_commands(config) if "ray stop" in c]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_setup_installs_the_project_into_a_venv(path: Path) -> None:
    config = _cluster(path)
    extra = "cpu" if path.name == "cluster-local.yaml" else "gpu"
    assert f"bash ~/prefixmesh/manifests/cluster/setup-node.sh {extra}" in config["setup_commands"]
    assert config["file_mounts"]["~/prefixmesh"] == "."
    # The password (and the HF token) reach the nodes in a folder outside the repository.
    assert config["file_mounts"]["~/.prefixmesh-secrets"] == "~/.prefixmesh-secrets"
    assert ".gitignore" in config["rsync_filter"]  # .venv stays behind
    for command in _all_commands(config):
        # A quoted ~ is not expanded (pip refused "~/prefixmesh[gpu]").
        assert not re.search(r"[\"']~", command), command
        assert "pip install -e" not in command  # setup-node.sh installs, into its venv


def test_setup_node_makes_a_python_311_venv() -> None:
    script = (MANIFESTS / "cluster" / "setup-node.sh").read_text()
    assert "sys.version_info < (3, 11)" in script and "--python 3.11" in script
    assert 'pip install -e "$src[$extra]"' in script


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_start_command_sources_node_env_first(path: Path) -> None:
    """Ray runs each command in its own SSH session, and the raylet's environment is what Ray's
    workers get: every command that starts something sources node-env.sh in that command."""
    config = _cluster(path)
    head = [_node_env_args(c) for c in config["head_start_ray_commands"]]
    workers = [_node_env_args(c) for c in config["worker_start_ray_commands"]]
    assert all(args == head[0] for args in head)
    head_ip, redis_port, serve_config = head[0]
    assert workers == [["$RAY_HEAD_IP", redis_port, serve_config]]
    if path.name == "cluster-local.yaml":
        assert head_ip == config["provider"]["head_ip"]
    else:
        assert head_ip == "$(hostname -I | awk '{print $1}')"
    assert ROOT / serve_config.removeprefix("~/prefixmesh/") == _serve_config_of(path)
    head_start = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    worker_start = config["worker_start_ray_commands"][0]
    gcs_port = _flags(head_start)["port"]
    assert f"--address=$RAY_HEAD_IP:{gcs_port}" in worker_start
    assert gcs_port != redis_port


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_serve_deploy_leaves_the_registry_url_to_the_environment(path: Path) -> None:
    serve_config = yaml.safe_load(_serve_config_of(path).read_text())
    registry = serve_config["applications"][0]["args"]["settings"]["registry"]
    assert registry == {"backend": "redis"}  # the URL is PREFIXMESH_REDIS_URL (node-env.sh)
    config = _cluster(path)
    deploy = next(c for c in config["head_start_ray_commands"] if "serve deploy" in c)
    head_start = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    assert _flags(deploy)["address"] == (
        f"http://127.0.0.1:{_flags(head_start).get('dashboard-port', '8265')}"
    )


@pytest.mark.parametrize("path", GPU_CLUSTERS, ids=lambda p: p.name)
def test_gpu_clusters_fetch_the_served_model_on_every_node(path: Path) -> None:
    """Replicas and routers load the model offline (prefixmesh.app.replica_env)."""
    model = _app_config(yaml.safe_load(_serve_config_of(path).read_text())).replica.model_path
    fetch = [c for c in _cluster(path)["setup_commands"] if "snapshot_download" in c]
    assert fetch and f"snapshot_download('{model}')" in fetch[0]
    assert "HF_TOKEN=$(cat ~/.prefixmesh-secrets/hf-token)" in fetch[0]


def test_local_cluster_is_loopback_on_ports_no_other_cluster_uses() -> None:
    config = _cluster(MANIFESTS / "cluster" / "cluster-local.yaml")
    assert config["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    auth = config["auth"]
    assert auth["ssh_user"] != "root" and auth["ssh_private_key"]
    # Ray 2.60 has no SSH port setting: the ProxyCommand dials the port itself. rsync re-splits
    # the ssh command line Ray gives it, so no double quotes or backslashes.
    proxy = auth["ssh_proxy_command"]
    assert "/dev/tcp/%h/${PREFIXMESH_SSH_PORT:-2222}" in proxy
    assert '"' not in proxy and "\\" not in proxy
    head_start = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    flags = _flags(head_start)
    assert flags["node-ip-address"] == flags["dashboard-host"] == "127.0.0.1"
    for flag, default in RAY_DEFAULT_PORTS.items():
        assert int(flags[flag]) != default, flag
    assert int(flags["min-worker-port"]) > 19999  # Ray's workers default to 10002-19999
    assert flags["temp-dir"] != "/tmp/ray"
    redis_port = int(_node_env_args(head_start)[1])
    assert redis_port not in (6379, 16379)  # Ray's GCS default, the registry's default
    local = MANIFESTS / "cluster" / "cluster-local.yaml"
    http = yaml.safe_load(_serve_config_of(local).read_text())
    assert http["http_options"] == {"host": "127.0.0.1", "port": 28000}
    ports = [int(flags[f]) for f in RAY_DEFAULT_PORTS] + [redis_port, 28000]
    assert len(set(ports)) == len(ports)


def test_gpu_serve_config_documents_the_registry_environment() -> None:
    text = (MANIFESTS / "serve" / "gpu.yaml").read_text()
    assert "PREFIXMESH_REDIS_URL" in text and "PREFIXMESH_REDIS_PASSWORD" in text
    assert "127.0.0.1:16379" not in text


# --- KubeRay ---------------------------------------------------------------------------------


def _documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(RAYSERVICE.read_text()))


def _kind(kind: str) -> dict[str, Any]:
    return next(d for d in _documents() if d["kind"] == kind)


def _ray_pods() -> dict[str, dict[str, Any]]:
    cluster = _kind("RayService")["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster["workerGroupSpecs"]:
        pods[group["groupName"]] = group["template"]["spec"]
    return pods


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def _serve_config_v2() -> dict[str, Any]:
    return yaml.safe_load(_kind("RayService")["spec"]["serveConfigV2"])  # type: ignore[no-any-return]


def test_the_rayservice_serve_config_passes_rays_schema() -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(_serve_config_v2())
    assert [app.import_path for app in schema.applications] == ["prefixmesh.app:app_builder"]


def test_the_rayservice_serve_config_builds(tmp_path: Path) -> None:
    from ray.serve import Application

    service = _kind("RayService")
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"
    apps = _build(_serve_config_v2(), tmp_path)
    assert apps and all(isinstance(a, Application) for a in apps)
    assert {d["kind"] for d in _documents()} == {"RayService", "ConfigMap", "Deployment", "Service"}


def test_the_operator_reaches_the_dashboard() -> None:
    head = _kind("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (container,) = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["dashboard"] == 8265 and ports["serve"] == 8000


def test_passwords_and_tokens_come_from_secrets() -> None:
    for name, pod in _ray_pods().items():
        for container in pod["containers"]:
            env = _env(container)
            assert _secret_ref(env["PREFIXMESH_REDIS_PASSWORD"]) == ("prefixmesh-redis", "password")
            assert _secret_ref(env["HF_TOKEN"]) == ("prefixmesh-hf", "token"), name
        for init in pod["initContainers"]:
            assert _secret_ref(_env(init)["HF_TOKEN"]) == ("prefixmesh-hf", "token")
    redis = _kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert _secret_ref(_env(redis)["REDIS_PASSWORD"]) == ("prefixmesh-redis", "password")
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"


def test_no_literal_secret_anywhere() -> None:
    kinds = [d["kind"] for d in _documents()]
    assert "Secret" not in kinds  # created with kubectl, never committed

    def walk(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    secret = re.compile(r"PASSWORD|TOKEN|SECRET", re.IGNORECASE)
    for document in _documents():
        for node in walk(document):
            if "name" in node and secret.search(str(node["name"])) and "valueFrom" not in node:
                pytest.fail(f"literal value for {node['name']} in {document['kind']}")
            for key in node:
                if secret.search(str(key)) and document["kind"] == "ConfigMap":
                    pytest.fail(f"{key} in the ConfigMap")
    assert "requirepass" not in _serve_config_v2()["applications"][0]["args"]["settings"]


def test_the_node_environment_is_the_serve_configs_serving_settings() -> None:
    """The ConfigMap holds what node-env.sh derives on a `ray up` node: the registry's URL and
    HAProxy's settings from serveConfigV2's serving section."""
    serving = _app_config(_serve_config_v2()).serving
    assert serving.path == "direct" and isinstance(serving, ServingConfig)
    fallback_ports = iter(["8500", "9500"])  # Ray's defaults, pinned in the ConfigMap
    expected = haproxy_environment(serving, "/tmp/pmh", port=lambda: next(fallback_ports))
    data = _kind("ConfigMap")["data"]
    assert data == {"PREFIXMESH_REDIS_URL": "redis://prefixmesh-redis:6379/0", **expected}
    service = _kind("Service")
    assert service["metadata"]["name"] == "prefixmesh-redis"
    assert service["spec"]["ports"][0]["port"] == 6379
    for pod in _ray_pods().values():
        for container in pod["containers"]:
            assert container["envFrom"] == [{"configMapRef": {"name": "prefixmesh-node-env"}}]


def test_the_gpu_worker_group_asks_for_gpus_and_tolerates_their_taint() -> None:
    pod = _ray_pods()["gpu"]
    resources = pod["containers"][0]["resources"]
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert gpus == int(resources["requests"]["nvidia.com/gpu"])
    assert gpus >= _app_config(_serve_config_v2()).replica.vllm.tensor_parallel_size
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert "nvidia.com/gpu" not in str(_ray_pods()["head"])


def test_the_pods_fetch_the_served_model() -> None:
    model = _app_config(_serve_config_v2()).replica.model_path
    for pod in _ray_pods().values():
        (init,) = pod["initContainers"]
        assert f"snapshot_download('{model}')" in init["command"][-1]
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        for container in pod["containers"]:
            assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["hf-cache"] == (
                mounts["hf-cache"]
            )


def _dockerfile_base_image() -> str:
    (default,) = re.findall(r"^ARG RAY_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    return default  # type: ignore[no-any-return]


def test_the_image_the_dockerfile_builds_is_the_one_the_manifests_name() -> None:
    service = _kind("RayService")
    base = _dockerfile_base_image()
    assert service["metadata"]["annotations"]["prefixmesh/base-image"] == base
    repository, _, tag = base.partition(":")
    assert repository == "rayproject/ray"
    version, python, _ = tag.split("-", 2)
    assert version == service["spec"]["rayClusterConfig"]["rayVersion"]
    assert re.fullmatch(r"py3(\d+)", python) and int(python[3:]) >= 11
    images = {
        c["image"]
        for pod in _ray_pods().values()
        for c in pod["containers"] + pod.get("initContainers", [])
    }
    (image,) = images
    assert f"-t {image} ." in DOCKERFILE.read_text()


def test_the_dockerfile_installs_every_package_folder_with_the_gpu_extra() -> None:
    setup = ast.parse((ROOT / "setup.py").read_text())
    folders = next(
        ast.literal_eval(node.value)
        for node in ast.walk(setup)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FOLDERS"
    )
    text = DOCKERFILE.read_text()
    allowed = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    for folder in set(folders.values()):
        assert f"COPY --chown=ray:users {folder}/ {folder}/" in text
        assert f"!{folder}/" in allowed
    assert 'pip install --no-cache-dir ".[gpu]"' in text


def test_app_builder_rejects_unknown_args() -> None:
    from prefixmesh.app import app_builder

    with pytest.raises(ValueError, match="unknown app args"):
        app_builder({"confg": "typo.yaml"})
